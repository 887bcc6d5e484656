//! The flow-control queues: one band per priority, one FIFO per flow inside a band.
//!
//! Dispatch takes the highest non-empty band first and, inside a band, serves its
//! flows in turn (round robin), so one busy tenant cannot starve the others of the
//! same priority. Every entry of one queue has the same TTL, so deadlines grow
//! along each FIFO and expiry only ever looks at fronts.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::Instant;

/// One queued request.
#[derive(Debug)]
pub(crate) struct Entry<T> {
    /// Identifies the entry for removal (a cancelled request).
    pub id: u64,
    /// Bytes the request holds (its body).
    pub bytes: usize,
    /// When its TTL runs out.
    pub deadline: Instant,
    /// What the caller waits on.
    pub waiter: T,
}

/// The FIFOs of one priority band and the order their flows are served in.
#[derive(Debug)]
struct Band<T> {
    flows: HashMap<String, VecDeque<Entry<T>>>,
    /// Flows with queued entries, next to serve first.
    turn: VecDeque<String>,
    len: usize,
    bytes: usize,
}

impl<T> Default for Band<T> {
    fn default() -> Self {
        Band {
            flows: HashMap::new(),
            turn: VecDeque::new(),
            len: 0,
            bytes: 0,
        }
    }
}

impl<T> Band<T> {
    fn forget_if_empty(&mut self, flow: &str) {
        if self.flows.get(flow).is_some_and(VecDeque::is_empty) {
            self.flows.remove(flow);
            self.turn.retain(|f| f != flow);
        }
    }
}

/// How much one (priority, flow) queue holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueLevel {
    /// The priority band.
    pub priority: i32,
    /// The flow (fairness id).
    pub flow: String,
    /// Requests queued.
    pub requests: usize,
    /// Bytes queued.
    pub bytes: usize,
}

/// Why an entry could not be queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Full {
    /// The band holds its most requests.
    Requests,
    /// The band would exceed its byte budget.
    Bytes,
}

/// Per-priority bands of per-flow FIFOs.
#[derive(Debug)]
pub(crate) struct Queues<T> {
    bands: BTreeMap<i32, Band<T>>,
    len: usize,
}

impl<T> Default for Queues<T> {
    fn default() -> Self {
        Queues {
            bands: BTreeMap::new(),
            len: 0,
        }
    }
}

impl<T> Queues<T> {
    /// Entries queued in all bands.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `entry` to `flow` in band `priority`, unless the band would then hold
    /// more than `max_requests` entries or `max_bytes` bytes.
    pub fn push(
        &mut self,
        priority: i32,
        flow: &str,
        entry: Entry<T>,
        max_requests: usize,
        max_bytes: usize,
    ) -> Result<(), (Full, Entry<T>)> {
        let band = self.bands.entry(priority).or_default();
        if band.len >= max_requests {
            return Err((Full::Requests, entry));
        }
        if band.bytes.saturating_add(entry.bytes) > max_bytes {
            return Err((Full::Bytes, entry));
        }
        band.len += 1;
        band.bytes += entry.bytes;
        self.len += 1;
        let fifo = band.flows.entry(flow.to_string()).or_default();
        if fifo.is_empty() {
            band.turn.push_back(flow.to_string());
        }
        fifo.push_back(entry);
        Ok(())
    }

    /// Takes the next entry to dispatch: the highest band, its next flow in turn.
    pub fn pop(&mut self) -> Option<Entry<T>> {
        let (&priority, band) = self.bands.iter_mut().rev().find(|(_, b)| b.len > 0)?;
        let flow = band.turn.pop_front()?;
        let fifo = band.flows.get_mut(&flow)?;
        let entry = fifo.pop_front()?;
        if fifo.is_empty() {
            band.flows.remove(&flow);
        } else {
            band.turn.push_back(flow);
        }
        band.len -= 1;
        band.bytes -= entry.bytes;
        self.len -= 1;
        self.drop_band_if_empty(priority);
        Some(entry)
    }

    /// Removes entry `id` from `flow` in band `priority`; `None` if it is gone already.
    pub fn remove(&mut self, priority: i32, flow: &str, id: u64) -> Option<Entry<T>> {
        let band = self.bands.get_mut(&priority)?;
        let fifo = band.flows.get_mut(flow)?;
        let at = fifo.iter().position(|e| e.id == id)?;
        let entry = fifo.remove(at)?;
        band.len -= 1;
        band.bytes -= entry.bytes;
        self.len -= 1;
        band.forget_if_empty(flow);
        self.drop_band_if_empty(priority);
        Some(entry)
    }

    /// Removes and returns every entry whose deadline is at or before `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Entry<T>> {
        let mut out = Vec::new();
        for band in self.bands.values_mut() {
            let mut emptied = Vec::new();
            for (flow, fifo) in band.flows.iter_mut() {
                while fifo.front().is_some_and(|e| e.deadline <= now) {
                    let e = fifo.pop_front().expect("front exists");
                    band.len -= 1;
                    band.bytes -= e.bytes;
                    out.push(e);
                }
                if fifo.is_empty() {
                    emptied.push(flow.clone());
                }
            }
            for flow in emptied {
                band.forget_if_empty(&flow);
            }
        }
        self.len -= out.len();
        self.bands.retain(|_, b| b.len > 0);
        out
    }

    /// What each (priority, flow) queue holds.
    pub fn levels(&self) -> Vec<QueueLevel> {
        let mut out: Vec<QueueLevel> = self
            .bands
            .iter()
            .flat_map(|(&priority, band)| {
                band.flows.iter().map(move |(flow, fifo)| QueueLevel {
                    priority,
                    flow: flow.clone(),
                    requests: fifo.len(),
                    bytes: fifo.iter().map(|e| e.bytes).sum(),
                })
            })
            .collect();
        out.sort_by(|a, b| (b.priority, &a.flow).cmp(&(a.priority, &b.flow)));
        out
    }

    fn drop_band_if_empty(&mut self, priority: i32) {
        if self.bands.get(&priority).is_some_and(|b| b.len == 0) {
            self.bands.remove(&priority);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn entry(id: u64, bytes: usize, deadline: Instant) -> Entry<u64> {
        Entry {
            id,
            bytes,
            deadline,
            waiter: id,
        }
    }

    #[test]
    fn highest_band_first_and_flows_take_turns() {
        let t = Instant::now() + Duration::from_secs(60);
        let mut q = Queues::default();
        for (id, prio, flow) in [
            (1, 0, "a"),
            (2, 0, "a"),
            (3, 0, "a"),
            (4, 0, "b"),
            (5, 5, "c"),
            (6, 0, "b"),
        ] {
            q.push(prio, flow, entry(id, 1, t), 100, 100).unwrap();
        }
        let order: Vec<u64> = std::iter::from_fn(|| q.pop().map(|e| e.id)).collect();
        assert_eq!(order, vec![5, 1, 4, 2, 6, 3]);
        assert!(q.is_empty());
        assert!(q.levels().is_empty());
    }

    #[test]
    fn band_limits_requests_and_bytes() {
        let t = Instant::now();
        let mut q = Queues::default();
        q.push(0, "a", entry(1, 60, t), 2, 100).unwrap();
        assert_eq!(
            q.push(0, "a", entry(2, 50, t), 2, 100).unwrap_err().0,
            Full::Bytes
        );
        q.push(0, "b", entry(3, 40, t), 2, 100).unwrap();
        assert_eq!(
            q.push(0, "c", entry(4, 0, t), 2, 100).unwrap_err().0,
            Full::Requests
        );
        // Another band has its own budget.
        q.push(1, "a", entry(5, 100, t), 2, 100).unwrap();
        assert_eq!(q.len(), 3);
    }

    #[test]
    fn remove_and_expire_keep_counts_and_turns() {
        let now = Instant::now();
        let mut q = Queues::default();
        q.push(0, "a", entry(1, 10, now), 9, 999).unwrap();
        q.push(0, "a", entry(2, 10, now + Duration::from_secs(5)), 9, 999)
            .unwrap();
        q.push(0, "b", entry(3, 10, now + Duration::from_secs(5)), 9, 999)
            .unwrap();
        assert_eq!(q.remove(0, "b", 3).map(|e| e.id), Some(3));
        assert!(q.remove(0, "b", 3).is_none());
        let expired: Vec<u64> = q.expire(now).into_iter().map(|e| e.id).collect();
        assert_eq!(expired, vec![1]);
        assert_eq!(
            q.levels(),
            vec![QueueLevel {
                priority: 0,
                flow: "a".into(),
                requests: 1,
                bytes: 10
            }]
        );
        assert_eq!(q.pop().map(|e| e.id), Some(2));
        assert!(q.pop().is_none() && q.is_empty());
    }
}
