//! What every request on this worker's VM shares: the metrics, the store
//! clients, and the requests' carriers, so that the answer to any callout,
//! whichever context Envoy hands it to, reaches the request it belongs to.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use idemgate_core::config::Config;
use idemgate_core::exchange::{refusal, settled, Settlement};
use proxy_wasm::types::LogLevel;

use crate::carrier::Carrier;
use crate::client::{Answers, Owner, StoreClient};
use crate::host;
use crate::metrics::Metrics;
use crate::outbox::Outbox;

/// Detached exchanges held at most once their client has left; beyond that
/// a client that leaves gets the streaming outcome (the record turns unknown).
const MAX_ORPHANS: usize = 4_096;

pub struct Shared {
    pub config: Rc<Config>,
    pub metrics: Metrics,
    /// The requests' claims and settlements, group-committed.
    pub client: RefCell<StoreClient>,
    /// Calls that must outlive their request (abandoned claims, unknown
    /// outcomes): sent from the root, so that the store's answer arrives
    /// while someone is still there to count it, and sent again until the
    /// store has answered.
    pub outbox: RefCell<Outbox>,
    /// Every covered request waiting on a callout, or still attached to its
    /// client, by HTTP context id.
    carriers: RefCell<HashMap<Owner, Rc<RefCell<Carrier>>>>,
    /// Detached upstream requests in flight, by callout token.
    upstream_calls: RefCell<HashMap<u32, Owner>>,
    /// Carriers whose client has left.
    orphans: Cell<usize>,
}

impl Shared {
    pub fn new(config: Rc<Config>) -> Shared {
        Shared {
            metrics: Metrics::define(&config),
            config,
            client: RefCell::default(),
            outbox: RefCell::default(),
            carriers: RefCell::default(),
            upstream_calls: RefCell::default(),
            orphans: Cell::new(0),
        }
    }

    pub fn register(&self, owner: Owner, carrier: Rc<RefCell<Carrier>>) {
        self.carriers.borrow_mut().insert(owner, carrier);
    }

    /// The request's client has left. An exchange that must go on stays
    /// here until its last callout is answered.
    pub fn client_left(&self, owner: Owner) {
        let Some(carrier) = self.carriers.borrow_mut().remove(&owner) else {
            return;
        };
        let mut c = carrier.borrow_mut();
        if !c.client_left() {
            return;
        }
        if self.orphans.get() >= MAX_ORPHANS {
            host::log(
                LogLevel::Warn,
                "too many detached requests without a client; this one's record will be unknown",
            );
            c.give_up();
            return;
        }
        drop(c);
        self.orphans.set(self.orphans.get() + 1);
        self.carriers.borrow_mut().insert(owner, carrier);
    }

    pub fn upstream_sent(&self, token: u32, owner: Owner) {
        self.upstream_calls.borrow_mut().insert(token, owner);
    }

    /// The answer to one of this worker's callouts, whichever context Envoy
    /// handed it to.
    pub fn answer(&self, token: u32, num_headers: usize, body_size: usize) {
        let answered = self
            .client
            .borrow_mut()
            .answered(token, || host::store_answer(num_headers, body_size));
        if let Some((answers, group)) = answered {
            self.hand_out(answers);
            if group {
                self.flush();
            }
            return;
        }
        let owner = self.upstream_calls.borrow_mut().remove(&token);
        if let Some(owner) = owner {
            self.with_carrier(owner, |c| c.upstream_answered(num_headers, body_size));
            return;
        }
        self.outbox_answer(token, num_headers, body_size);
    }

    /// Sends what queued up while the group's callout was in flight; calls
    /// Envoy refused to send are answered with nothing, which may queue more.
    fn flush(&self) {
        loop {
            let refused = self.client.borrow_mut().flush(self.config.store());
            if refused.is_empty() {
                return;
            }
            self.hand_out(refused);
        }
    }

    fn hand_out(&self, answers: Answers) {
        for (owner, answer) in answers {
            self.with_carrier(owner, |c| c.store_answered(answer));
        }
    }

    /// Gives `owner`'s carrier its answer; a carrier whose client has left
    /// is let go once it waits on nothing.
    fn with_carrier(&self, owner: Owner, answered: impl FnOnce(&mut Carrier)) {
        let Some(carrier) = self.carriers.borrow().get(&owner).cloned() else {
            return;
        };
        let mut c = carrier.borrow_mut();
        answered(&mut c);
        if !c.attached() && !c.pending() {
            c.close();
            self.carriers.borrow_mut().remove(&owner);
            self.orphans.set(self.orphans.get().saturating_sub(1));
        }
    }

    fn outbox_answer(&self, token: u32, num_headers: usize, body_size: usize) {
        let answer = host::store_answer(num_headers, body_size);
        let Some(ended) = self.outbox.borrow_mut().answered(token, answer) else {
            return;
        };
        for (settles, policy, answer) in ended {
            if settled(&answer) {
                self.metrics.count_settlement(&policy, settles);
                continue;
            }
            if let Some((status, detail)) = refusal(&answer) {
                self.metrics.config_error(status, &detail);
            }
            host::log(
                LogLevel::Warn,
                &format!(
                    "the store did not confirm a record {}; its lease will settle it",
                    settles.as_str()
                ),
            );
            self.metrics.count_settlement(&policy, Settlement::Failed);
        }
    }
}
