//! The routing decision: candidates → filters → scores → pick.
//!
//! Pure core: no gRPC, Kubernetes or network types. The ext_proc glue hands in a
//! parsed request and an endpoint [`Snapshot`]; this module returns a [`Decision`]
//! naming the decode (destination) worker rank and, in disaggregated pools, the
//! prefill worker rank.

use std::sync::Arc;

use rand::Rng;

use crate::endpoints::{EndpointState, InFlightGuard, Role, Snapshot};
use crate::request::InferenceRequest;

/// Why no endpoint could be picked (answered with 503).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PickError {
    /// The endpoint set is empty (or nothing is ready).
    #[error("no ready endpoint in the pool")]
    NoEndpoints,
    /// A subset hint matched none of the ready endpoints.
    #[error("no ready endpoint matches the subset hint")]
    SubsetEmpty,
    /// Endpoints exist, but none can serve as decode destination.
    #[error("no ready decode-capable endpoint in the pool")]
    NoDecodeEndpoint,
}

/// What the scheduler needs to know about one request.
#[derive(Debug, Default, Clone, Copy)]
pub struct PickRequest<'a> {
    /// The parsed body; `None` for header-only requests (e.g. `GET /v1/models`).
    pub body: Option<&'a InferenceRequest>,
    /// Addresses (`ip:port`) the gateway restricts the choice to, if any.
    pub subset: Option<&'a [String]>,
    /// Session id from the session header, for clients that cannot edit the body.
    pub session_id: Option<&'a str>,
    /// Signed session token from an earlier response.
    pub session_token: Option<&'a str>,
}

/// One chosen (worker, rank).
#[derive(Debug, Clone)]
pub struct Target {
    /// The endpoint.
    pub endpoint: Arc<EndpointState>,
    /// The data-parallel rank inside it.
    pub rank: u32,
}

/// The routing decision for one request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Where the request goes (decode side in disaggregated pools).
    pub decode: Target,
    /// The prefill worker in disaggregated pools.
    pub prefill: Option<Target>,
    /// Random 63-bit bootstrap room when the prefill worker has a bootstrap port.
    pub bootstrap_room: Option<u64>,
}

impl Decision {
    /// Starts counting the request as in flight on its decode rank.
    pub fn begin(&self) -> InFlightGuard {
        self.decode.endpoint.begin_request(self.decode.rank)
    }
}

/// Picks endpoints for requests.
#[derive(Debug, Default)]
pub struct Scheduler {}

impl Scheduler {
    /// A scheduler with default settings.
    pub fn new() -> Self {
        Scheduler {}
    }

    /// Chooses the decode target (and a prefill target in disaggregated pools).
    pub fn pick(&self, req: &PickRequest<'_>, snapshot: &Snapshot) -> Result<Decision, PickError> {
        if snapshot.endpoints.is_empty() {
            return Err(PickError::NoEndpoints);
        }
        let candidates: Vec<&Arc<EndpointState>> = match req.subset {
            Some(subset) => {
                let c: Vec<_> = snapshot
                    .endpoints
                    .iter()
                    .filter(|e| subset.iter().any(|s| *s == e.endpoint.address_string()))
                    .collect();
                if c.is_empty() {
                    return Err(PickError::SubsetEmpty);
                }
                c
            }
            None => snapshot.endpoints.iter().collect(),
        };
        let decode = least_loaded(
            candidates
                .iter()
                .copied()
                .filter(|e| e.endpoint.role.serves_decode()),
        )
        .ok_or(PickError::NoDecodeEndpoint)?;
        let prefill = if req.body.is_some() {
            least_loaded(
                candidates
                    .iter()
                    .copied()
                    .filter(|e| e.endpoint.role == Role::Prefill),
            )
        } else {
            None
        };
        let bootstrap_room = prefill
            .as_ref()
            .and_then(|p| p.endpoint.endpoint.bootstrap_port)
            .map(|_| rand::rng().random::<u64>() >> 1);
        Ok(Decision {
            decode,
            prefill,
            bootstrap_room,
        })
    }

    /// Headers to add to the response of a routed request (e.g. a session token).
    pub fn response_headers(&self, _decision: &Decision) -> Option<Vec<(String, String)>> {
        None
    }

    /// The request has finished; `status` is the response's HTTP status when one arrived.
    pub fn finish(&self, _decision: &Decision, _status: Option<u16>) {}
}

/// The (endpoint, rank) with the fewest in-flight requests; ties broken uniformly at random.
fn least_loaded<'a>(candidates: impl Iterator<Item = &'a Arc<EndpointState>>) -> Option<Target> {
    let mut rng = rand::rng();
    let mut best: Option<(u32, Target)> = None;
    let mut ties = 0u32;
    for e in candidates {
        for rank in 0..e.ranks() {
            let load = e.in_flight(rank);
            match &best {
                Some((b, _)) if load > *b => continue,
                Some((b, _)) if load == *b => {
                    ties += 1;
                    // Reservoir sampling over equally loaded targets.
                    if rng.random_range(0..=ties) != 0 {
                        continue;
                    }
                }
                _ => ties = 0,
            }
            best = Some((
                load,
                Target {
                    endpoint: Arc::clone(e),
                    rank,
                },
            ));
        }
    }
    best.map(|(_, t)| t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::{Endpoint, EndpointTable};
    use std::collections::HashSet;

    fn table(specs: &[(&str, u32, Role)]) -> EndpointTable {
        let t = EndpointTable::new();
        t.replace(
            specs
                .iter()
                .map(|(a, dp, role)| {
                    let mut e = Endpoint::new(a.parse().unwrap());
                    e.dp_size = *dp;
                    e.role = *role;
                    e
                })
                .collect(),
        );
        t
    }

    #[test]
    fn empty_pool_and_empty_subset_are_errors() {
        let s = Scheduler::new();
        let t = EndpointTable::new();
        assert_eq!(
            s.pick(&PickRequest::default(), &t.snapshot()).unwrap_err(),
            PickError::NoEndpoints
        );
        let t = table(&[("10.0.0.1:80", 1, Role::Both)]);
        let subset = vec!["10.9.9.9:80".to_string()];
        let req = PickRequest {
            subset: Some(&subset),
            ..Default::default()
        };
        assert_eq!(
            s.pick(&req, &t.snapshot()).unwrap_err(),
            PickError::SubsetEmpty
        );
    }

    #[test]
    fn spreads_over_ranks_by_in_flight() {
        let s = Scheduler::new();
        let t = table(&[
            ("10.0.0.1:80", 2, Role::Both),
            ("10.0.0.2:80", 1, Role::Both),
        ]);
        let snap = t.snapshot();
        let mut guards = Vec::new();
        let mut seen = HashSet::new();
        for _ in 0..3 {
            let d = s.pick(&PickRequest::default(), &snap).unwrap();
            seen.insert(d.decode.endpoint.key(d.decode.rank));
            guards.push(d.begin());
        }
        assert_eq!(seen.len(), 3, "three idle ranks each get one request");
    }

    #[test]
    fn disaggregated_pool_picks_prefill_and_decode() {
        let s = Scheduler::new();
        let t = table(&[
            ("10.0.0.1:80", 1, Role::Prefill),
            ("10.0.0.2:80", 1, Role::Decode),
        ]);
        let body = crate::request::parse(br#"{"model":"m","prompt":"x"}"#, None).unwrap();
        let d = s
            .pick(
                &PickRequest {
                    body: Some(&body),
                    ..Default::default()
                },
                &t.snapshot(),
            )
            .unwrap();
        assert_eq!(
            d.decode.endpoint.endpoint.address.to_string(),
            "10.0.0.2:80"
        );
        assert_eq!(
            d.prefill.unwrap().endpoint.endpoint.address.to_string(),
            "10.0.0.1:80"
        );
        let only_prefill = table(&[("10.0.0.1:80", 1, Role::Prefill)]);
        assert_eq!(
            s.pick(&PickRequest::default(), &only_prefill.snapshot())
                .unwrap_err(),
            PickError::NoDecodeEndpoint
        );
    }
}
