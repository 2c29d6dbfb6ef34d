//! Quote batches: one TPM quote vouches for many handshakes at once.
//!
//! An issuer collects the requests that arrive while its TPM is busy and
//! quotes once over the root of a hash tree whose leaves are the requests'
//! (nonce, user data) pairs. Each document carries its leaf's inclusion
//! path, so every verifier still gets evidence for its own nonce: it
//! recomputes the root from its nonce, the document's user data and the
//! path, and the quote must carry exactly that root
//! ([`crate::quote::qualifying_data`]). A request served alone is a tree of
//! one leaf, whose root is the leaf and whose path is empty: there is one
//! format and one way to check it.
//!
//! Hashes (SHA-256, each domain-separated so a leaf can never pass for an
//! interior node or the padding):
//!
//! * leaf = `H("keel-quote-leaf-v2" || u16be(len(nonce)) || nonce || user_data)`;
//! * node = `H("keel-quote-node-v2" || left || right)`;
//! * padding = `H("keel-quote-empty-v2")`: the leaf level is padded to the
//!   next power of two with it, so every path of a tree has the same length
//!   and the bits of the leaf index, lowest first, say on which side each
//!   step goes (0: the running hash is the left child).
//!
//! A path is the leaf index and at most [`MAX_DEPTH`] sibling hashes
//! (trees of at most [`MAX_LEAVES`] leaves); an index that needs more bits
//! than the path has steps is refused, so one leaf has exactly one path.

use sha2::{Digest as _, Sha256};

use crate::measurement::Digest32;

/// Most steps in an inclusion path.
pub const MAX_DEPTH: usize = 8;
/// Most leaves in one tree (one quote).
pub const MAX_LEAVES: usize = 1 << MAX_DEPTH;
/// The longest nonce a leaf encodes: its length is a 16-bit field, so a
/// longer nonce would be ambiguous, and [`leaf`] refuses it. keel's own
/// nonces are 32 bytes.
pub const MAX_NONCE_BYTES: usize = u16::MAX as usize;

const LEAF_CONTEXT: &[u8] = b"keel-quote-leaf-v2";
const NODE_CONTEXT: &[u8] = b"keel-quote-node-v2";
const EMPTY_CONTEXT: &[u8] = b"keel-quote-empty-v2";

/// Why a tree cannot be built or a path is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// A tree needs at least one leaf.
    #[error("a quote batch needs at least one leaf")]
    Empty,
    /// More leaves than one tree holds.
    #[error("a quote batch holds at most {MAX_LEAVES} leaves, not {0}")]
    TooManyLeaves(usize),
    /// The path has more steps than any tree has levels.
    #[error("quote batch path has {0} steps; at most {MAX_DEPTH} are allowed")]
    PathTooLong(usize),
    /// A sibling is not a SHA-256 digest.
    #[error("quote batch path step {0} is not 32 bytes")]
    SiblingLength(usize),
    /// The leaf index needs more bits than the path has steps.
    #[error("quote batch leaf index {index} does not fit a path of {depth} steps")]
    IndexOutOfRange {
        /// The index the document gives.
        index: u32,
        /// The number of steps in its path.
        depth: usize,
    },
    /// The nonce is longer than a leaf encodes ([`MAX_NONCE_BYTES`]).
    #[error("nonce of {0} bytes; a quote batch leaf encodes at most {MAX_NONCE_BYTES}")]
    NonceTooLong(usize),
}

/// The leaf of one request: its nonce and user data. A nonce longer than
/// [`MAX_NONCE_BYTES`] is refused: its length would not fit the leaf's
/// length field, and the leaf would equal that of a cut nonce followed by
/// other user data.
pub fn leaf(nonce: &[u8], user_data: &[u8]) -> Result<Digest32, BatchError> {
    let len = u16::try_from(nonce.len()).map_err(|_| BatchError::NonceTooLong(nonce.len()))?;
    let mut h = Sha256::new();
    h.update(LEAF_CONTEXT);
    h.update(len.to_be_bytes());
    h.update(nonce);
    h.update(user_data);
    Ok(h.finalize().into())
}

fn node(left: &Digest32, right: &Digest32) -> Digest32 {
    let mut h = Sha256::new();
    h.update(NODE_CONTEXT);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

fn empty() -> Digest32 {
    Sha256::digest(EMPTY_CONTEXT).into()
}

/// Where one leaf sits in its tree: its index and the sibling hashes from
/// the leaf level up. Always within the bounds (see [`InclusionPath::new`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InclusionPath {
    index: u32,
    siblings: Vec<Digest32>,
}

impl InclusionPath {
    /// The path of a document: `index` and `siblings` as it carries them.
    /// Refuses more than [`MAX_DEPTH`] steps, siblings that are not 32
    /// bytes and an index that does not fit the path.
    pub fn new(index: u32, siblings: &[impl AsRef<[u8]>]) -> Result<Self, BatchError> {
        if siblings.len() > MAX_DEPTH {
            return Err(BatchError::PathTooLong(siblings.len()));
        }
        if u64::from(index) >> siblings.len() != 0 {
            return Err(BatchError::IndexOutOfRange {
                index,
                depth: siblings.len(),
            });
        }
        let siblings = siblings
            .iter()
            .enumerate()
            .map(|(step, s)| {
                s.as_ref()
                    .try_into()
                    .map_err(|_| BatchError::SiblingLength(step))
            })
            .collect::<Result<_, _>>()?;
        Ok(Self { index, siblings })
    }

    /// The leaf index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The sibling hashes, from the leaf level up.
    pub fn siblings(&self) -> &[Digest32] {
        &self.siblings
    }

    /// The root of the tree that holds `leaf` at this path.
    pub fn root(&self, leaf: &Digest32) -> Digest32 {
        self.siblings
            .iter()
            .enumerate()
            .fold(*leaf, |hash, (step, sibling)| {
                if (self.index >> step) & 1 == 0 {
                    node(&hash, sibling)
                } else {
                    node(sibling, &hash)
                }
            })
    }
}

/// A whole tree, as an issuer builds it for one quote.
#[derive(Clone, Debug)]
pub struct Tree {
    /// Level 0 is the padded leaves; the last level is the root alone.
    levels: Vec<Vec<Digest32>>,
    leaves: usize,
}

impl Tree {
    /// The tree over `leaves` (1 to [`MAX_LEAVES`]), in their order.
    pub fn new(leaves: &[Digest32]) -> Result<Self, BatchError> {
        if leaves.is_empty() {
            return Err(BatchError::Empty);
        }
        if leaves.len() > MAX_LEAVES {
            return Err(BatchError::TooManyLeaves(leaves.len()));
        }
        let width = leaves.len().next_power_of_two();
        let mut level = leaves.to_vec();
        level.resize(width, empty());
        let mut levels = vec![level];
        while let Some(below) = levels.last().filter(|l| l.len() > 1) {
            let above = below
                .chunks_exact(2)
                .map(|pair| node(&pair[0], &pair[1]))
                .collect();
            levels.push(above);
        }
        Ok(Self {
            levels,
            leaves: leaves.len(),
        })
    }

    /// The number of leaves (without the padding).
    pub fn len(&self) -> usize {
        self.leaves
    }

    /// Whether the tree has no leaves (never: [`Tree::new`] refuses that).
    pub fn is_empty(&self) -> bool {
        self.leaves == 0
    }

    /// The root: what the quote's qualifying data commits to.
    pub fn root(&self) -> Digest32 {
        self.levels
            .last()
            .and_then(|top| top.first())
            .copied()
            .unwrap_or_else(empty)
    }

    /// The inclusion path of leaf `index`, or `None` past the last leaf.
    pub fn path(&self, index: usize) -> Option<InclusionPath> {
        if index >= self.leaves {
            return None;
        }
        let depth = self.levels.len() - 1;
        let siblings = self.levels[..depth]
            .iter()
            .enumerate()
            .map(|(step, level)| level.get((index >> step) ^ 1).copied())
            .collect::<Option<Vec<_>>>()?;
        Some(InclusionPath {
            index: u32::try_from(index).ok()?,
            siblings,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;

    fn leaves(n: usize) -> Vec<Digest32> {
        (0..n)
            .map(|i| leaf(&(i as u32).to_be_bytes(), b"user data").unwrap())
            .collect()
    }

    #[test]
    fn every_leaf_of_every_size_leads_to_the_root_and_only_its_own_path_does() {
        for n in [1, 2, 3, 4, 5, 7, 8, 9, 100, 255, MAX_LEAVES] {
            let leaves = leaves(n);
            let tree = Tree::new(&leaves).unwrap();
            assert_eq!(tree.len(), n);
            let depth = n.next_power_of_two().trailing_zeros() as usize;
            for (i, l) in leaves.iter().enumerate() {
                let path = tree.path(i).unwrap();
                assert_eq!(path.siblings().len(), depth, "{n} leaves");
                assert_eq!(path.root(l), tree.root(), "leaf {i} of {n}");
                // The path as a document carries it parses back to itself.
                let wire: Vec<Vec<u8>> = path.siblings().iter().map(|s| s.to_vec()).collect();
                assert_eq!(InclusionPath::new(path.index(), &wire).unwrap(), path);
                // Another leaf's path, or another leaf on this path, misses.
                if n > 1 {
                    let other = tree.path((i + 1) % n).unwrap();
                    assert_ne!(other.root(l), tree.root());
                    assert_ne!(path.root(&leaves[(i + 1) % n]), tree.root());
                }
            }
            assert!(tree.path(n).is_none());
        }
    }

    #[test]
    fn a_single_leaf_is_its_own_root_with_an_empty_path() {
        let l = leaf(b"nonce", b"key").unwrap();
        let tree = Tree::new(&[l]).unwrap();
        assert_eq!(tree.root(), l);
        let path = tree.path(0).unwrap();
        assert!(path.siblings().is_empty());
        assert_eq!(path.root(&l), l);
    }

    #[test]
    fn tampered_paths_miss_the_root() {
        let leaves = leaves(6);
        let tree = Tree::new(&leaves).unwrap();
        let path = tree.path(2).unwrap();
        let wire: Vec<Vec<u8>> = path.siblings().iter().map(|s| s.to_vec()).collect();
        // A flipped bit in any sibling.
        for step in 0..wire.len() {
            let mut flipped = wire.clone();
            flipped[step][0] ^= 1;
            let p = InclusionPath::new(2, &flipped).unwrap();
            assert_ne!(p.root(&leaves[2]), tree.root(), "step {step}");
        }
        // Any other index that fits the path.
        for index in (0..8).filter(|i| *i != 2) {
            let p = InclusionPath::new(index, &wire).unwrap();
            assert_ne!(p.root(&leaves[2]), tree.root(), "index {index}");
        }
        // Swapped siblings, a step dropped or added.
        let mut swapped = wire.clone();
        swapped.swap(0, 1);
        assert_ne!(
            InclusionPath::new(2, &swapped).unwrap().root(&leaves[2]),
            tree.root()
        );
        assert_ne!(
            InclusionPath::new(2, &wire[..2]).unwrap().root(&leaves[2]),
            tree.root()
        );
        let mut longer = wire.clone();
        longer.push(vec![0; 32]);
        assert_ne!(
            InclusionPath::new(2, &longer).unwrap().root(&leaves[2]),
            tree.root()
        );
    }

    #[test]
    fn paths_out_of_bounds_are_refused() {
        let step = vec![0u8; 32];
        assert_eq!(
            InclusionPath::new(0, &vec![step.clone(); MAX_DEPTH + 1]),
            Err(BatchError::PathTooLong(MAX_DEPTH + 1))
        );
        assert!(InclusionPath::new(255, &vec![step.clone(); MAX_DEPTH]).is_ok());
        assert_eq!(
            InclusionPath::new(4, &vec![step.clone(); 2]),
            Err(BatchError::IndexOutOfRange { index: 4, depth: 2 })
        );
        assert_eq!(
            InclusionPath::new(1, &Vec::<Vec<u8>>::new()),
            Err(BatchError::IndexOutOfRange { index: 1, depth: 0 })
        );
        assert_eq!(
            InclusionPath::new(0, &[step.clone(), vec![0; 31]]),
            Err(BatchError::SiblingLength(1))
        );
        assert_eq!(Tree::new(&[]).unwrap_err(), BatchError::Empty);
        assert_eq!(
            Tree::new(&leaves(MAX_LEAVES + 1)).unwrap_err(),
            BatchError::TooManyLeaves(MAX_LEAVES + 1)
        );
    }

    #[test]
    fn a_nonce_longer_than_the_length_field_makes_no_leaf() {
        let longest = vec![1u8; MAX_NONCE_BYTES];
        leaf(&longest, b"u").unwrap();
        let longer = vec![1u8; MAX_NONCE_BYTES + 1];
        assert_eq!(
            leaf(&longer, b"u").unwrap_err(),
            BatchError::NonceTooLong(MAX_NONCE_BYTES + 1)
        );
    }

    #[test]
    fn leaves_nodes_and_padding_are_domain_separated() {
        let (a, b) = (leaf(b"n", b"u").unwrap(), leaf(b"n2", b"u").unwrap());
        // The nonce's length is bound: moving bytes between nonce and user
        // data changes the leaf.
        assert_ne!(leaf(b"nu", b"").unwrap(), leaf(b"n", b"u").unwrap());
        // A leaf whose bytes are an interior node's input is not that node.
        let mut joined = a.to_vec();
        joined.extend_from_slice(&b);
        assert_ne!(leaf(&[], &joined).unwrap(), node(&a, &b));
        assert_ne!(node(&a, &b), node(&b, &a));
        assert_ne!(empty(), leaf(b"", b"").unwrap());
    }

    /// The hashes are the wire format a verifier elsewhere recomputes: each
    /// input, its domain tag included, is pinned here by known answers
    /// (computed apart from this code).
    #[test]
    fn leaves_nodes_and_padding_hash_as_specified() {
        let (a, b) = (leaf(b"n", b"u").unwrap(), leaf(b"n2", b"u").unwrap());
        // SHA-256("keel-quote-leaf-v2" || u16be(1) || "n" || "u")
        assert_eq!(
            hex::encode(a),
            "224a70eb9c0edc86c874f274db22e951aa140aa6963a517d8090dfafeea6441d"
        );
        // SHA-256("keel-quote-node-v2" || a || b)
        assert_eq!(
            hex::encode(node(&a, &b)),
            "61adf0427f0ca5d3d6bcdf7e8efadb68aa80cf66e5e268fc8901b695804520b3"
        );
        // SHA-256("keel-quote-empty-v2")
        assert_eq!(
            hex::encode(empty()),
            "3fb1deea45e1b2e1bda116316bf14588a9a8db0f3616e78415e83cd49928d1cc"
        );
    }
}
