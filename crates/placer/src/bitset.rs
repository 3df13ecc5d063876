//! A growable set of small integers: which packs a node holds, one bit each,
//! so pricing a job on fifty nodes is fifty passes of bit tests, not hashing.

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Bitset {
    words: Vec<u64>,
}

impl Bitset {
    pub(crate) fn contains(&self, i: u32) -> bool {
        let (w, b) = (i as usize / 64, i % 64);
        self.words.get(w).is_some_and(|x| x & (1 << b) != 0)
    }

    /// Sets bit `i`; true when it was not set.
    pub(crate) fn insert(&mut self, i: u32) -> bool {
        let (w, b) = (i as usize / 64, i % 64);
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        let was = self.words[w] & (1 << b) != 0;
        self.words[w] |= 1 << b;
        !was
    }

    /// Clears bit `i`; true when it was set.
    pub(crate) fn remove(&mut self, i: u32) -> bool {
        let (w, b) = (i as usize / 64, i % 64);
        match self.words.get_mut(w) {
            Some(x) if *x & (1 << b) != 0 => {
                *x &= !(1 << b);
                true
            }
            _ => false,
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.words.iter().enumerate().flat_map(|(w, &x)| {
            let mut x = x;
            std::iter::from_fn(move || {
                (x != 0).then(|| {
                    let b = x.trailing_zeros();
                    x &= x - 1;
                    w as u32 * 64 + b
                })
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_remove_iterate() {
        let mut s = Bitset::default();
        assert!(!s.contains(200));
        assert!(s.insert(200));
        assert!(!s.insert(200));
        assert!(s.insert(3));
        assert!(s.insert(64));
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![3, 64, 200]);
        assert!(s.remove(64));
        assert!(!s.remove(64));
        assert!(!s.remove(10_000));
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![3, 200]);
    }
}
