//! Seeded chance, one stream per component. A scenario's knobs and faults
//! and each of the world's sources of chance (clients, upstream, each
//! fault) draw from a stream of their own, named and derived from one
//! seed: a knob or a fault added later draws from its own new stream, so
//! every recorded case still draws what it drew before.

/// splitmix64: a seeded stream of chances.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// The stream `name` of `seed`.
    pub fn stream(seed: u64, name: &str) -> Rng {
        // FNV-1a of the name, mixed into the seed: streams of one seed are
        // unrelated, and a name always names the same stream.
        let named = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let mut mixer = Rng(seed ^ named);
        Rng(mixer.draw())
    }

    pub fn draw(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// In `lo..hi` (`lo` when the range is empty).
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        let span = u64::try_from(hi.saturating_sub(lo)).unwrap_or(0).max(1);
        lo + i64::try_from(self.draw() % span).unwrap_or(0)
    }

    /// In `0.0..1.0`.
    pub fn unit(&mut self) -> f64 {
        (self.draw() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// True with probability `p`; draws nothing when `p` is zero, so a
    /// fault that is off leaves its stream untouched.
    pub fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.unit() < p
    }

    /// One of `choices`.
    pub fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        let i = self.range(0, choices.len() as i64);
        choices[usize::try_from(i).unwrap_or(0)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_of_one_seed_differ_and_each_is_the_same_every_time() {
        let (mut a, mut b) = (Rng::stream(7, "network"), Rng::stream(7, "upstream"));
        assert_ne!(a.draw(), b.draw());
        assert_eq!(Rng::stream(7, "network").draw(), Rng::stream(7, "network").draw());
        assert_ne!(Rng::stream(7, "network").draw(), Rng::stream(8, "network").draw());
    }

    #[test]
    fn a_chance_of_zero_draws_nothing() {
        let mut r = Rng::stream(1, "x");
        let before = r.clone().draw();
        assert!(!r.chance(0.0));
        assert_eq!(r.draw(), before);
    }
}
