//! Python's `random.Random`, as far as lm-evaluation-harness uses it to draw few-shot exemplars:
//! the Mersenne Twister (MT19937) seeded from an integer as CPython seeds it, `getrandbits`,
//! `_randbelow` and `sample`. The same seed draws the same exemplars as the harness.

const N: usize = 624;
const M: usize = 397;

pub struct PyRandom {
    state: [u32; N],
    index: usize,
}

impl PyRandom {
    /// `random.Random(seed)` for a non-negative integer seed (CPython's `init_by_array` over the
    /// seed's 32-bit words, least significant first).
    pub fn new(seed: u64) -> Self {
        let mut key = vec![seed as u32];
        if seed >> 32 != 0 {
            key.push((seed >> 32) as u32);
        }
        let mut r = Self { state: [0; N], index: N };
        r.init_genrand(19_650_218);
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let prev = r.state[i - 1] ^ (r.state[i - 1] >> 30);
            r.state[i] = (r.state[i] ^ prev.wrapping_mul(1_664_525)).wrapping_add(key[j]).wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                r.state[0] = r.state[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = r.state[i - 1] ^ (r.state[i - 1] >> 30);
            r.state[i] = (r.state[i] ^ prev.wrapping_mul(1_566_083_941)).wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                r.state[0] = r.state[N - 1];
                i = 1;
            }
        }
        r.state[0] = 0x8000_0000;
        r
    }

    fn init_genrand(&mut self, s: u32) {
        self.state[0] = s;
        for i in 1..N {
            let prev = self.state[i - 1] ^ (self.state[i - 1] >> 30);
            self.state[i] = 1_812_433_253u32.wrapping_mul(prev).wrapping_add(i as u32);
        }
        self.index = N;
    }

    fn next_u32(&mut self) -> u32 {
        if self.index >= N {
            for k in 0..N {
                let y = (self.state[k] & 0x8000_0000) | (self.state[(k + 1) % N] & 0x7fff_ffff);
                let mag = if y & 1 == 1 { 0x9908_b0df } else { 0 };
                self.state[k] = self.state[(k + M) % N] ^ (y >> 1) ^ mag;
            }
            self.index = 0;
        }
        let mut y = self.state[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `getrandbits(k)` for `1 <= k <= 32`.
    fn getrandbits(&mut self, k: u32) -> u32 {
        self.next_u32() >> (32 - k)
    }

    /// `_randbelow(n)` for `1 <= n < 2^32`: rejection sampling over `n.bit_length()` bits.
    pub fn randbelow(&mut self, n: usize) -> usize {
        let k = usize::BITS - n.leading_zeros();
        loop {
            let r = self.getrandbits(k) as usize;
            if r < n {
                return r;
            }
        }
    }

    /// The indices `random.sample(range(n), k)` returns, in its order (the pool algorithm for
    /// small populations, the set algorithm for large ones, as CPython chooses).
    ///
    /// # Panics
    /// If `k > n`.
    pub fn sample(&mut self, n: usize, k: usize) -> Vec<usize> {
        assert!(k <= n, "sample larger than population");
        let mut setsize = 21usize;
        if k > 5 {
            // 4 ** ceil(log(k * 3, 4))
            let exp = ((k * 3) as f64).ln() / 4f64.ln();
            setsize += 4usize.pow(exp.ceil() as u32);
        }
        if n <= setsize {
            let mut pool: Vec<usize> = (0..n).collect();
            (0..k)
                .map(|i| {
                    let j = self.randbelow(n - i);
                    let picked = pool[j];
                    pool[j] = pool[n - i - 1];
                    picked
                })
                .collect()
        } else {
            let mut selected = std::collections::HashSet::new();
            (0..k)
                .map(|_| loop {
                    let j = self.randbelow(n);
                    if selected.insert(j) {
                        break j;
                    }
                })
                .collect()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `[random.Random(1234).getrandbits(32) for _ in range(3)]` and
    /// `random.Random(1234).sample(range(10042), 5)` / `sample(range(20), 6)` in CPython 3.11.
    #[test]
    fn draws_as_cpython() {
        let mut r = PyRandom::new(1234);
        let bits: Vec<u32> = (0..3).map(|_| r.next_u32()).collect();
        assert_eq!(bits, PY_BITS);
        assert_eq!(PyRandom::new(1234).sample(10042, 5), PY_SAMPLE_LARGE);
        assert_eq!(PyRandom::new(1234).sample(20, 6), PY_SAMPLE_SMALL);
        let mut r = PyRandom::new(42);
        let twice: Vec<Vec<usize>> = (0..2).map(|_| r.sample(300, 4)).collect();
        assert_eq!(twice, PY_SAMPLE_TWICE);
    }

    const PY_BITS: [u32; 3] = [4150886329, 3342196574, 1892932127];
    const PY_SAMPLE_LARGE: [usize; 5] = [7220, 1914, 122, 1485, 9539];
    const PY_SAMPLE_SMALL: [usize; 6] = [14, 3, 0, 2, 1, 10];
    const PY_SAMPLE_TWICE: [[usize; 4]; 2] = [[57, 12, 140, 125], [114, 71, 52, 279]];
}
