//! The wire form of a batch of [`Delta`]s: one stream entry per batch.
//!
//! Little-endian, fixed-width: version byte, sender's replica id, sender's
//! wall clock (µs since the Unix epoch, for the propagation figure), delta
//! count, then each delta as a tag byte and its fields. A prompt is its
//! worker, the sender's LRU key for it and its chained block hashes (8 bytes
//! a block, one delta a decision). Decoding checks every length against the
//! bytes left, so a bad entry costs at most its own size.
//!
//! A latency-model delta ([`Delta::Models`]) is a prior and a counted list of
//! (worker, model), each model its two fits' estimate and inverse information
//! matrix (counted `f64`s), observation count and recent error; it is
//! published in an entry of its own, so a reader that does not know its tag
//! skips (and counts) that entry alone. At most [`MAX_SHARED_MODELS`] models
//! and [`MAX_FIT_VALUES`] values a fit decode.
//!
//! Versions: 2 (written) carries each prompt's LRU key; 1 (still read, from
//! replicas not yet upgraded) has none, and its prompts rank at the batch's
//! send time. A version-1 reader skips and counts version-2 entries.

use std::time::Duration;

use crate::endpoints::{ActiveLoad, WorkerKey};
use crate::latency::rls::RlsSnapshot;
use crate::latency::{WorkerSnapshot, MAX_SHARED_MODELS};
use crate::replica::{Delta, ReplicaId, WorkerLoad};

const VERSION: u8 = 2;
/// The version before prompts carried their LRU key.
const VERSION_UNKEYED: u8 = 1;
const PROMPT: u8 = 1;
const BOOK: u8 = 2;
const RELEASE: u8 = 3;
const BIND: u8 = 4;
const UNBIND: u8 = 5;
const LOADS: u8 = 6;
const MODELS: u8 = 7;
/// Most values one fit's estimate or matrix may carry on the wire.
pub const MAX_FIT_VALUES: usize = 256;

/// A decoded batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// The sending replica.
    pub from: ReplicaId,
    /// The sender's wall clock when it published, in µs since the Unix epoch.
    pub sent_us: u64,
    /// The deltas, in the order the sender made them.
    pub deltas: Vec<Delta>,
}

/// Why an entry could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Another wire version.
    #[error("unknown replica-sync version {0}")]
    Version(u8),
    /// The bytes end early.
    #[error("truncated replica-sync batch")]
    Truncated,
    /// An unknown delta tag.
    #[error("unknown replica-sync delta tag {0}")]
    Tag(u8),
    /// A session id that is not UTF-8.
    #[error("replica-sync session id is not UTF-8")]
    SessionId,
    /// More latency models, or fit values, than a delta may carry.
    #[error("replica-sync latency models over their bound")]
    TooManyModels,
}

/// Encodes a batch.
pub fn encode(from: ReplicaId, sent_us: u64, deltas: &[Delta]) -> Vec<u8> {
    let mut b = Vec::with_capacity(21 + deltas.len() * 40);
    b.push(VERSION);
    b.extend_from_slice(&from.to_le_bytes());
    b.extend_from_slice(&sent_us.to_le_bytes());
    b.extend_from_slice(&(deltas.len() as u32).to_le_bytes());
    for d in deltas {
        match d {
            Delta::Prompt { worker, hashes, at } => {
                b.push(PROMPT);
                put_worker(&mut b, *worker);
                b.extend_from_slice(&at.to_le_bytes());
                b.extend_from_slice(&(hashes.len() as u32).to_le_bytes());
                for h in hashes {
                    b.extend_from_slice(&h.to_le_bytes());
                }
            }
            Delta::Book {
                worker,
                load,
                requests,
            } => put_load(&mut b, BOOK, *worker, *load, *requests),
            Delta::Release {
                worker,
                load,
                requests,
            } => put_load(&mut b, RELEASE, *worker, *load, *requests),
            Delta::Bind {
                session,
                decode,
                prefill,
                timeout,
            } => {
                b.push(BIND);
                put_worker(&mut b, *decode);
                match prefill {
                    Some(p) => {
                        b.push(1);
                        put_worker(&mut b, *p);
                    }
                    None => b.push(0),
                }
                b.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
                put_str(&mut b, session);
            }
            Delta::Unbind { session } => {
                b.push(UNBIND);
                put_str(&mut b, session);
            }
            Delta::Loads(loads) => {
                b.push(LOADS);
                b.extend_from_slice(&(loads.len() as u32).to_le_bytes());
                for l in loads {
                    put_worker(&mut b, l.worker);
                    b.extend_from_slice(&l.load.blocks.to_le_bytes());
                    b.extend_from_slice(&l.load.uncached.to_le_bytes());
                    b.extend_from_slice(&l.requests.to_le_bytes());
                }
            }
            Delta::Models { prior, workers } => {
                b.push(MODELS);
                put_model(&mut b, prior);
                b.extend_from_slice(&(workers.len() as u32).to_le_bytes());
                for (w, m) in workers {
                    put_worker(&mut b, *w);
                    put_model(&mut b, m);
                }
            }
        }
    }
    b
}

fn put_model(b: &mut Vec<u8>, m: &WorkerSnapshot) {
    for fit in [&m.ttft, &m.tpot] {
        put_f64s(b, &fit.theta);
        put_f64s(b, &fit.p);
    }
    b.extend_from_slice(&m.observations.to_le_bytes());
    b.extend_from_slice(&m.recent_error.to_le_bytes());
}

fn put_f64s(b: &mut Vec<u8>, v: &[f64]) {
    b.extend_from_slice(&(v.len() as u16).to_le_bytes());
    for x in v {
        b.extend_from_slice(&x.to_le_bytes());
    }
}

fn put_worker(b: &mut Vec<u8>, w: WorkerKey) {
    b.extend_from_slice(&w.instance_id.to_le_bytes());
    b.extend_from_slice(&w.dp_rank.to_le_bytes());
}

fn put_load(b: &mut Vec<u8>, tag: u8, w: WorkerKey, load: ActiveLoad, requests: u32) {
    b.push(tag);
    put_worker(b, w);
    b.extend_from_slice(&load.blocks.to_le_bytes());
    b.extend_from_slice(&load.uncached.to_le_bytes());
    b.extend_from_slice(&requests.to_le_bytes());
}

/// Session ids longer than this are cut (a client controls them).
const MAX_SESSION_ID: usize = 1024;

fn put_str(b: &mut Vec<u8>, s: &str) {
    let mut end = s.len().min(MAX_SESSION_ID);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    b.extend_from_slice(&(end as u16).to_le_bytes());
    b.extend_from_slice(&s.as_bytes()[..end]);
}

/// Decodes a batch.
pub fn decode(bytes: &[u8]) -> Result<Batch, DecodeError> {
    let mut r = Reader(bytes);
    let version = r.u8()?;
    if version != VERSION && version != VERSION_UNKEYED {
        return Err(DecodeError::Version(version));
    }
    let from = r.u64()?;
    let sent_us = r.u64()?;
    let n = r.u32()? as usize;
    // Every delta takes at least 5 bytes: no allocation beyond the entry's size.
    let mut deltas = Vec::with_capacity(n.min(r.0.len() / 5));
    for _ in 0..n {
        deltas.push(match r.u8()? {
            PROMPT => {
                let worker = r.worker()?;
                let at = match version {
                    VERSION_UNKEYED => sent_us.saturating_mul(1_000),
                    _ => r.u64()?,
                };
                let len = r.u32()? as usize;
                if len > r.0.len() / 8 {
                    return Err(DecodeError::Truncated);
                }
                let hashes = (0..len).map(|_| r.u64()).collect::<Result<_, _>>()?;
                Delta::Prompt { worker, hashes, at }
            }
            BOOK => {
                let (worker, load, requests) = r.load()?;
                Delta::Book {
                    worker,
                    load,
                    requests,
                }
            }
            RELEASE => {
                let (worker, load, requests) = r.load()?;
                Delta::Release {
                    worker,
                    load,
                    requests,
                }
            }
            BIND => {
                let decode = r.worker()?;
                let prefill = match r.u8()? {
                    0 => None,
                    _ => Some(r.worker()?),
                };
                let timeout = Duration::from_millis(r.u64()?);
                Delta::Bind {
                    decode,
                    prefill,
                    timeout,
                    session: r.str()?,
                }
            }
            UNBIND => Delta::Unbind { session: r.str()? },
            LOADS => {
                let len = r.u32()? as usize;
                if len > r.0.len() / 32 {
                    return Err(DecodeError::Truncated);
                }
                let mut loads = Vec::with_capacity(len);
                for _ in 0..len {
                    let (worker, load, requests) = r.load()?;
                    loads.push(WorkerLoad {
                        worker,
                        load,
                        requests,
                    });
                }
                Delta::Loads(loads)
            }
            MODELS => {
                let prior = r.model()?;
                let len = r.u32()? as usize;
                if len > MAX_SHARED_MODELS {
                    return Err(DecodeError::TooManyModels);
                }
                let mut workers = Vec::with_capacity(len.min(r.0.len() / 12));
                for _ in 0..len {
                    workers.push((r.worker()?, r.model()?));
                }
                Delta::Models { prior, workers }
            }
            t => return Err(DecodeError::Tag(t)),
        });
    }
    Ok(Batch {
        from,
        sent_us,
        deltas,
    })
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(DecodeError::Truncated)?;
        self.0 = rest;
        Ok(*head)
    }
    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take::<1>()?[0])
    }
    fn u16(&mut self) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.take()?))
    }
    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn worker(&mut self) -> Result<WorkerKey, DecodeError> {
        Ok(WorkerKey {
            instance_id: self.u64()?,
            dp_rank: self.u32()?,
        })
    }
    fn load(&mut self) -> Result<(WorkerKey, ActiveLoad, u32), DecodeError> {
        let worker = self.worker()?;
        let load = ActiveLoad {
            blocks: self.u64()?,
            uncached: self.u64()?,
        };
        Ok((worker, load, self.u32()?))
    }
    fn model(&mut self) -> Result<WorkerSnapshot, DecodeError> {
        let ttft = RlsSnapshot {
            theta: self.f64s()?,
            p: self.f64s()?,
        };
        let tpot = RlsSnapshot {
            theta: self.f64s()?,
            p: self.f64s()?,
        };
        Ok(WorkerSnapshot {
            ttft,
            tpot,
            observations: self.u64()?,
            recent_error: f64::from_bits(self.u64()?),
            // Not on the wire: each replica learns it from its own scrapes.
            slots: 0.0,
        })
    }
    fn f64s(&mut self) -> Result<Vec<f64>, DecodeError> {
        let len = self.u16()? as usize;
        if len > MAX_FIT_VALUES {
            return Err(DecodeError::TooManyModels);
        }
        if len > self.0.len() / 8 {
            return Err(DecodeError::Truncated);
        }
        (0..len).map(|_| Ok(f64::from_bits(self.u64()?))).collect()
    }
    fn str(&mut self) -> Result<String, DecodeError> {
        let len = self.u16()? as usize;
        if len > self.0.len() {
            return Err(DecodeError::Truncated);
        }
        let (s, rest) = self.0.split_at(len);
        self.0 = rest;
        String::from_utf8(s.to_vec()).map_err(|_| DecodeError::SessionId)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(i: u64) -> WorkerKey {
        WorkerKey {
            instance_id: i,
            dp_rank: 1,
        }
    }

    fn all() -> Vec<Delta> {
        let load = ActiveLoad {
            blocks: 9,
            uncached: 4,
        };
        vec![
            Delta::Prompt {
                worker: w(1),
                hashes: vec![1, 2, u64::MAX],
                at: 1_700_000_000_123_456_789,
            },
            Delta::Book {
                worker: w(2),
                load,
                requests: 1,
            },
            Delta::Release {
                worker: w(2),
                load,
                requests: 0,
            },
            Delta::Bind {
                session: "s-ü".into(),
                decode: w(3),
                prefill: Some(w(4)),
                timeout: Duration::from_secs(60),
            },
            Delta::Unbind {
                session: "s-ü".into(),
            },
            Delta::Loads(vec![WorkerLoad {
                worker: w(5),
                load,
                requests: 3,
            }]),
            Delta::Models {
                prior: model(7),
                workers: vec![(w(6), model(40)), (w(7), model(u64::MAX))],
            },
        ]
    }

    fn model(observations: u64) -> WorkerSnapshot {
        let mut m =
            crate::latency::WorkerModel::new([0.02, 0.1, 0.1, 0.02, 0.001, 0.1], [0.01; 4], 2.0)
                .to_snapshot();
        m.observations = observations;
        m.recent_error = 0.125;
        m
    }

    #[test]
    fn every_delta_round_trips() {
        let bytes = encode(7, 123, &all());
        let b = decode(&bytes).unwrap();
        assert_eq!((b.from, b.sent_us), (7, 123));
        assert_eq!(b.deltas, all());
    }

    #[test]
    fn every_truncation_and_bad_header_is_an_error() {
        let bytes = encode(7, 123, &all());
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n]).is_err(), "prefix of {n} bytes");
        }
        let mut v = bytes.clone();
        v[0] = 9;
        assert_eq!(decode(&v), Err(DecodeError::Version(9)));
        // A huge count with nothing behind it allocates nothing big.
        let mut huge = encode(1, 1, &[]);
        huge[17..21].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&huge), Err(DecodeError::Truncated));
    }

    #[test]
    fn latency_models_past_their_bounds_are_refused_before_allocation() {
        let too_many = Delta::Models {
            prior: model(1),
            workers: vec![(w(1), model(1)); MAX_SHARED_MODELS + 1],
        };
        assert_eq!(
            decode(&encode(1, 1, &[too_many])),
            Err(DecodeError::TooManyModels)
        );
        let mut long_fit = model(1);
        long_fit.ttft.theta = vec![0.0; MAX_FIT_VALUES + 1];
        let bytes = encode(
            1,
            1,
            &[Delta::Models {
                prior: long_fit,
                workers: Vec::new(),
            }],
        );
        assert_eq!(decode(&bytes), Err(DecodeError::TooManyModels));
    }

    #[test]
    fn a_version_1_prompt_ranks_at_its_batch_send_time() {
        // Version 1 wrote a prompt as tag, worker, count, hashes: no key.
        let mut v1 = vec![VERSION_UNKEYED];
        v1.extend_from_slice(&7u64.to_le_bytes());
        v1.extend_from_slice(&123u64.to_le_bytes());
        v1.extend_from_slice(&1u32.to_le_bytes());
        v1.push(PROMPT);
        put_worker(&mut v1, w(1));
        v1.extend_from_slice(&2u32.to_le_bytes());
        v1.extend_from_slice(&5u64.to_le_bytes());
        v1.extend_from_slice(&6u64.to_le_bytes());
        let b = decode(&v1).unwrap();
        assert_eq!(
            b.deltas,
            vec![Delta::Prompt {
                worker: w(1),
                hashes: vec![5, 6],
                at: 123_000,
            }]
        );
    }

    #[test]
    fn long_session_ids_are_cut_on_a_char_boundary() {
        let id = "é".repeat(MAX_SESSION_ID);
        let b = decode(&encode(1, 1, &[Delta::Unbind { session: id }])).unwrap();
        let Delta::Unbind { session } = &b.deltas[0] else {
            panic!()
        };
        assert_eq!(session.len(), MAX_SESSION_ID);
    }
}
