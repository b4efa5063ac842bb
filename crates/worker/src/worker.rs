//! What every request on this worker's VM shares: the metrics, the store
//! client, and the requests' drivers, so that the answer to any callout,
//! whichever context Envoy hands it to, reaches the request it belongs to.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use idemgate_core::client::{Bound, Delivery, Letter, Owner, BOUND};
use idemgate_core::config::Config;
use idemgate_core::handling::Settlement;
use idemgate_core::store_call::{refusal, settled, StoreAnswer, StoreCall};

use crate::client::{Pumped, Queue, StoreClient};
use crate::driver::Driver;
use crate::host::{self, Host, Level};
use crate::metrics::Metrics;

pub struct Worker<H: Host> {
    pub host: H,
    pub config: Rc<Config>,
    pub metrics: Metrics<H>,
    client: RefCell<StoreClient>,
    /// Every covered request waiting on a callout, or still attached to its
    /// client, by HTTP context id. A driver whose client has left stays
    /// until its last callout is answered: a detached upstream request
    /// (bounded by its timeout, and in number by the cluster's circuit
    /// breakers) or the call recording its outcome (bounded by the store
    /// call's timeout). It is never cut short while the upstream may act.
    drivers: RefCell<HashMap<Owner, Rc<RefCell<Driver<H>>>>>,
    /// Detached upstream requests in flight, by callout token.
    upstream_calls: RefCell<HashMap<u32, Owner>>,
}

impl<H: Host> Worker<H> {
    pub fn new(host: H, config: Rc<Config>) -> Worker<H> {
        Worker::bounded(host, config, BOUND)
    }

    /// A worker whose store client's queues each keep at most `bound`.
    pub fn bounded(host: H, config: Rc<Config>, bound: Bound) -> Worker<H> {
        Worker {
            metrics: Metrics::define(host.clone(), &config),
            client: RefCell::new(StoreClient::new(&host, bound)),
            host,
            config,
            drivers: RefCell::default(),
            upstream_calls: RefCell::default(),
        }
    }

    pub fn register(&self, owner: Owner, driver: Rc<RefCell<Driver<H>>>) {
        self.drivers.borrow_mut().insert(owner, driver);
    }

    /// Queues a call `owner` waits for; `false` when the queue is full (the
    /// request fails closed at once).
    pub fn submit(&self, owner: Owner, call: StoreCall) -> bool {
        let taken = self
            .client
            .borrow_mut()
            .attached
            .submit(owner, call, self.host.now_ms());
        if taken.is_err() {
            self.metrics.store_queue_full();
        }
        taken.is_ok()
    }

    /// Posts a call that outlives its request.
    pub fn post(&self, letter: Letter) {
        let pushed_out = self.client.borrow_mut().letters.post(letter, self.host.now_ms());
        if let Some(letter) = pushed_out {
            self.letter_ended(letter, Delivery::GaveUp);
        }
    }

    /// The request's client has left. An exchange that must go on stays
    /// here until its last callout is answered; any other's calls not yet
    /// sent are dropped.
    pub fn client_left(&self, owner: Owner) {
        let Some(driver) = self.drivers.borrow_mut().remove(&owner) else {
            return;
        };
        let goes_on = driver.borrow_mut().client_left();
        if goes_on {
            self.drivers.borrow_mut().insert(owner, driver);
        } else {
            self.client.borrow_mut().attached.left(owner);
        }
        self.pump();
    }

    pub fn upstream_sent(&self, token: u32, owner: Owner) {
        self.upstream_calls.borrow_mut().insert(token, owner);
    }

    /// The answer to one of this worker's callouts, whichever context Envoy
    /// handed it to.
    pub fn answer(&self, token: u32, num_headers: usize, body_size: usize) {
        let taken = self.client.borrow_mut().take(token);
        if let Some((_, _, sent)) = taken {
            let took = self.host.now_us().saturating_sub(sent);
            self.metrics.store_call(u64::try_from(took).unwrap_or(0));
        }
        match taken {
            Some((Queue::Attached, flight, _)) => {
                let answer = self.host.store_answer(num_headers, body_size);
                let answers = self.client.borrow_mut().attached.answered(flight, answer);
                self.hand_out(answers);
            }
            Some((Queue::Letters, flight, _)) => {
                let answer = self.host.store_answer(num_headers, body_size);
                let ended = self
                    .client
                    .borrow_mut()
                    .letters
                    .answered(flight, answer, self.host.now_ms());
                for (letter, delivery) in ended {
                    self.letter_ended(letter, delivery);
                }
            }
            None => {
                let owner = self.upstream_calls.borrow_mut().remove(&token);
                if let Some(owner) = owner {
                    self.with_driver(owner, |c| c.upstream_answered(num_headers, body_size));
                }
            }
        }
        self.pump();
    }

    /// Nothing of this worker's is left to finish: no driver (attached or
    /// detached), no letter, no store call queued or in flight.
    pub fn drained(&self) -> bool {
        let client = self.client.borrow();
        self.drivers.borrow().is_empty()
            && self.upstream_calls.borrow().is_empty()
            && client.letters.is_empty()
            && client.attached.queued() == 0
            && client.in_flight() == 0
    }

    /// What is left to finish: drivers, letters, store calls in flight.
    pub fn outstanding(&self) -> (usize, usize, usize) {
        let client = self.client.borrow();
        (
            self.drivers.borrow().len(),
            client.letters.len(),
            client.in_flight(),
        )
    }

    /// Calls and bytes queued for the store.
    pub fn queued(&self) -> (usize, usize) {
        let client = self.client.borrow();
        (client.attached.queued(), client.attached.queued_bytes())
    }

    /// The attempts whose outcome this worker still holds: its requests'
    /// and its letters'. They go with it if its VM does.
    pub fn held(&self) -> Vec<String> {
        let drivers = self.drivers.borrow();
        let requests = drivers
            .values()
            .map(|d| d.borrow().exchange.attempt().as_str().to_string());
        let client = self.client.borrow();
        let letters = client.letters.attempts().map(|a| a.as_str().to_string());
        requests.chain(letters).collect()
    }

    /// The store client's timer is off (nothing queued waits for it).
    pub fn timer_off(&self) -> bool {
        self.client.borrow().timer_off()
    }

    /// Sends what the store client has ready, and hands out what came back
    /// at once (calls Envoy refused, callers that stopped waiting), which
    /// may queue more. Called at the end of every event, when no driver is
    /// borrowed.
    pub fn pump(&self) {
        loop {
            let Pumped { answers, ended } =
                self.client
                    .borrow_mut()
                    .pump(&self.host, self.config.store(), self.host.now_ms());
            if answers.is_empty() && ended.is_empty() {
                return;
            }
            self.hand_out(answers);
            for (letter, delivery) in ended {
                self.letter_ended(letter, delivery);
            }
        }
    }

    fn hand_out(&self, answers: Vec<(Owner, StoreAnswer)>) {
        for (owner, answer) in answers {
            self.with_driver(owner, |c| c.store_answered(answer));
        }
    }

    /// Gives `owner`'s driver its answer; a driver whose client has left
    /// is let go once it waits on nothing.
    fn with_driver(&self, owner: Owner, answered: impl FnOnce(&mut Driver<H>)) {
        let Some(driver) = self.drivers.borrow().get(&owner).cloned() else {
            return;
        };
        let mut c = driver.borrow_mut();
        answered(&mut c);
        if !c.attached() && !c.pending() {
            c.close();
            self.drivers.borrow_mut().remove(&owner);
        }
    }

    /// Counts what a letter settled once the store decided it; one the store
    /// refused or never heard is logged and counted as failed.
    fn letter_ended(&self, letter: Letter, delivery: Delivery) {
        let Letter {
            call,
            settles,
            policy,
            attempt,
        } = letter;
        let _about = host::about(&Rc::from(attempt.as_str()));
        if let Delivery::Decided(answer) = &delivery {
            if settled(answer) {
                self.metrics.count_settlement(&policy, settles);
                return;
            }
            if let Some((status, detail)) = refusal(answer) {
                self.metrics.config_error(status, &detail);
            }
        }
        let why = match delivery {
            Delivery::Decided(_) => "the store did not confirm",
            Delivery::GaveUp => "the store could not be reached in time for",
        };
        self.host.log(
            Level::Warn,
            &format!(
                "{why} {} (a record {}); its lease will settle it",
                call.path,
                settles.as_str()
            ),
        );
        self.metrics.count_settlement(&policy, Settlement::Failed);
    }
}
