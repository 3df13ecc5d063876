//! Room past the connection caps for the cluster's own signed requests.
//!
//! The caps ([`crate::ConnLimits`]) count connections per source address,
//! and a node's heartbeats share its address with every user logged in
//! there: 128 idle connections from one shell on gpu2 kept gpu2's
//! heartbeats out until the coordinator marked it down, and the same loop
//! against an agent stopped dispatch, kill and pack fetches. So a
//! connection over the caps is not closed at once: it takes a place in
//! this lane, whose size is its own, and is served only requests that carry
//! a good cluster signature (anything else gets 503 and the connection is
//! closed). A full lane makes room by closing the connection that has
//! waited longest for its first request's head: a node sends its head as
//! soon as it connects, an idle connection sits there, so idle connections
//! cannot keep the lane full however many are opened.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Places in the lane, all addresses together.
pub(crate) const LANE_PLACES: usize = 64;

/// How long a connection in the lane may take to send a request head (and
/// its TLS handshake): a node sends it at once.
pub(crate) const LANE_HEAD_TIMEOUT: Duration = Duration::from_secs(2);

/// The lane: how many places are held, and the connections that have not
/// sent a request head yet, oldest first.
#[derive(Clone)]
pub(crate) struct Lane {
    state: Arc<Mutex<State>>,
    places: usize,
}

#[derive(Default)]
struct State {
    next: u64,
    held: usize,
    waiting: VecDeque<Waiting>,
}

/// A connection without a request head yet: closed through `evict` when a
/// newer one needs its place.
struct Waiting {
    id: u64,
    evict: tokio::sync::oneshot::Sender<()>,
    /// Whether its place still counts (false once it was evicted: the
    /// newcomer took the count over).
    counted: Arc<AtomicBool>,
}

/// One connection's place in the lane, given back when it is dropped.
pub(crate) struct Place {
    id: u64,
    state: Arc<Mutex<State>>,
    counted: Arc<AtomicBool>,
}

impl Lane {
    /// A lane of `places` places.
    pub(crate) fn new(places: usize) -> Lane {
        Lane {
            state: Arc::default(),
            places,
        }
    }

    /// A place for a new connection, and what says it was evicted; `None`
    /// when every place holds a connection whose request is under way.
    pub(crate) fn admit(&self) -> Option<(Place, tokio::sync::oneshot::Receiver<()>)> {
        let mut s = self.state.lock().expect("lane poisoned");
        if s.held >= self.places {
            let oldest = s.waiting.pop_front()?;
            oldest.counted.store(false, Ordering::SeqCst);
            let _ = oldest.evict.send(());
            s.held -= 1;
        }
        s.held += 1;
        s.next += 1;
        let (id, counted) = (s.next, Arc::new(AtomicBool::new(true)));
        let (evict, evicted) = tokio::sync::oneshot::channel();
        s.waiting.push_back(Waiting {
            id,
            evict,
            counted: counted.clone(),
        });
        let place = Place {
            id,
            state: self.state.clone(),
            counted,
        };
        Some((place, evicted))
    }

    /// Places held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.state.lock().expect("lane poisoned").held
    }
}

impl Place {
    /// Its first request's head arrived: it can no longer be evicted.
    pub(crate) fn arrived(&self) {
        let mut s = self.state.lock().expect("lane poisoned");
        s.waiting.retain(|w| w.id != self.id);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        s.waiting.retain(|w| w.id != self.id);
        if self.counted.swap(false, Ordering::SeqCst) {
            s.held -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full lane evicts the connection that has waited longest for its
    /// head, never one whose request is under way, and counts each place
    /// once however it ends.
    #[test]
    fn a_full_lane_evicts_the_oldest_idle_connection() {
        let lane = Lane::new(2);
        let (a, mut a_evicted) = lane.admit().unwrap();
        let (b, mut b_evicted) = lane.admit().unwrap();
        b.arrived();
        let (c, mut c_evicted) = lane.admit().unwrap();
        assert!(a_evicted.try_recv().is_ok(), "the oldest idle one goes");
        assert!(b_evicted.try_recv().is_err() && c_evicted.try_recv().is_err());
        assert_eq!(lane.held(), 2);
        drop(a);
        assert_eq!(lane.held(), 2, "an evicted place is not given back twice");
        c.arrived();
        assert!(lane.admit().is_none(), "both places serve requests");
        drop(b);
        assert_eq!(lane.held(), 1);
        let (d, _) = lane.admit().unwrap();
        assert_eq!(lane.held(), 2);
        drop((c, d));
        assert_eq!(lane.held(), 0);
    }
}
