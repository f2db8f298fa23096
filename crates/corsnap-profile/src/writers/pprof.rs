//! pprof output (placeholder until the generated protobuf code lands).

use std::io::{self, Write};

use super::{ProfileWriter, WriteOptions};
use crate::Profile;

pub struct PprofWriter;

impl ProfileWriter for PprofWriter {
    fn write(&self, _profile: &Profile, _options: &WriteOptions, _out: &mut dyn Write) -> io::Result<()> {
        Err(io::Error::new(io::ErrorKind::Unsupported, "pprof output is not built yet"))
    }
}
