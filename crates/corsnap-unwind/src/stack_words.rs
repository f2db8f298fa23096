//! For unit tests: a stack of words at chosen addresses, and nothing else.

use std::collections::HashMap;
use std::ops::Range;

use crate::{ManagedCode, Memory};

/// A stack as a map from address to word; every other address is unreadable,
/// and there is no code to read.
pub(crate) struct StackWords(pub(crate) HashMap<u64, u64>);

impl Memory for StackWords {
    fn stack_word(&self, addr: u64) -> Option<u64> {
        self.0.get(&addr).copied()
    }
    fn code_bytes(&self, _: &ManagedCode, _: Range<u64>) -> Option<&[u8]> {
        None
    }
}
