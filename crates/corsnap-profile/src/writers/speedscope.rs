//! speedscope's own file format (<https://www.speedscope.app/file-format-schema.json>):
//! one sampled profile per thread, so speedscope's thread picker and its
//! time-ordered view both work.

use std::io::{self, BufWriter, Write};

use serde_json::{json, Map, Value};

use super::{ProfileWriter, WriteOptions};
use crate::{FrameIdx, Profile, Sample};

const SCHEMA_URL: &str = "https://www.speedscope.app/file-format-schema.json";

#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SpeedscopeWriter;

impl ProfileWriter for SpeedscopeWriter {
    /// `options.threads` is not needed here: every thread is its own profile.
    fn write(&self, profile: &Profile, options: &WriteOptions, out: &mut dyn Write) -> io::Result<()> {
        let document = speedscope_document(profile, options);
        let mut out = BufWriter::new(out);
        serde_json::to_writer(&mut out, &document)?;
        writeln!(out)?;
        out.flush()
    }
}

// Every object below lists its keys in sorted order. serde_json sorts keys
// unless some crate in the build turns on its `preserve_order` feature, in
// which case it keeps insertion order; sorted insertion makes both the same,
// so the bytes written never depend on what else is compiled in.
fn speedscope_document(profile: &Profile, options: &WriteOptions) -> Value {
    let title = options.title_for(&profile.meta);
    // speedscope's units: time in nanoseconds, allocations in bytes, and
    // plain counts for the rest.
    let unit = match super::single_kind(profile) {
        Some(crate::EventKind::Cpu | crate::EventKind::Gc) => "nanoseconds",
        Some(crate::EventKind::Alloc) => "bytes",
        _ => "none",
    };
    let mut shared_frames = SharedFrames::new(profile);
    let profiles: Vec<Value> = samples_by_thread(profile)
        .into_iter()
        .enumerate()
        .filter(|(_, samples)| !samples.is_empty())
        .map(|(thread, samples)| {
            let stacks: Vec<Vec<u32>> = samples
                .iter()
                .map(|sample| {
                    profile.stacks[sample.stack as usize]
                        .iter()
                        .rev()
                        .map(|&frame| shared_frames.index_of(frame))
                        .collect()
                })
                .collect();
            let weights: Vec<u64> = samples.iter().map(|sample| sample.weight).collect();
            let total_weight = weights.iter().fold(0u64, |sum, &weight| sum.saturating_add(weight));
            json!({
                "endValue": total_weight,
                "name": profile.thread_label(thread as u32),
                "samples": stacks,
                "startValue": 0,
                "type": "sampled",
                "unit": unit,
                "weights": weights,
            })
        })
        .collect();

    let mut document = Map::new();
    document.insert("$schema".into(), json!(SCHEMA_URL));
    // Pointing at a profile that does not exist would make speedscope fail
    // to open the file at all.
    if !profiles.is_empty() {
        document.insert("activeProfileIndex".into(), json!(0));
    }
    document.insert("exporter".into(), json!(concat!("corsnap ", env!("CARGO_PKG_VERSION"))));
    document.insert("name".into(), json!(title));
    document.insert("profiles".into(), Value::Array(profiles));
    document.insert("shared".into(), json!({ "frames": shared_frames.into_json(profile, options) }));
    Value::Object(document)
}

/// Each thread's samples in time order. The sort is stable, so samples taken
/// in the same nanosecond keep the order the agent sent them in.
fn samples_by_thread(profile: &Profile) -> Vec<Vec<&Sample>> {
    let mut by_thread: Vec<Vec<&Sample>> = vec![Vec::new(); profile.threads.len()];
    for sample in &profile.samples {
        by_thread[sample.thread as usize].push(sample);
    }
    for samples in &mut by_thread {
        samples.sort_by_key(|sample| sample.time_ns);
    }
    by_thread
}

/// The frames some sample refers to, numbered in order of first use so the
/// numbering depends only on the samples, not on what else was interned.
struct SharedFrames {
    index_by_frame: Vec<Option<u32>>,
    frames_in_order: Vec<FrameIdx>,
}

impl SharedFrames {
    fn new(profile: &Profile) -> Self {
        SharedFrames { index_by_frame: vec![None; profile.frames.len()], frames_in_order: Vec::new() }
    }

    fn index_of(&mut self, frame: FrameIdx) -> u32 {
        let slot = &mut self.index_by_frame[frame as usize];
        *slot.get_or_insert_with(|| {
            self.frames_in_order.push(frame);
            (self.frames_in_order.len() - 1) as u32
        })
    }

    /// Each frame as `{"file", "name"}`, and, when the name shown is not
    /// the runtime's, that one as `rawName` (speedscope shows only `name`
    /// and `file`, and keeps other keys out of its way).
    fn into_json(self, profile: &Profile, options: &WriteOptions) -> Vec<Value> {
        let names = super::frame_names(profile, options);
        self.frames_in_order
            .into_iter()
            .map(|idx| {
                let frame = &profile.frames[idx as usize];
                let name = &names[idx as usize];
                let mut object = Map::new();
                if !frame.module.is_empty() {
                    object.insert("file".into(), json!(frame.module));
                }
                object.insert("name".into(), json!(name));
                if *name != frame.name {
                    object.insert("rawName".into(), json!(frame.name));
                }
                Value::Object(object)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Meta, ProfileBuilder};

    fn render(profile: &Profile) -> Value {
        let mut json = Vec::new();
        SpeedscopeWriter.write(profile, &WriteOptions::default(), &mut json).unwrap();
        serde_json::from_slice(&json).expect("speedscope output is JSON")
    }

    #[test]
    fn samples_are_time_ordered_and_frames_shared() {
        let mut builder = ProfileBuilder::new();
        builder.apply(&corsnap_wire::Message::Function {
            function_id: 1,
            name: "A.Main".into(),
            module: "app.dll".into(),
        });
        builder.add_sample(30, 7, false, &[1], 1);
        builder.add_sample(10, 7, false, &[0, 1], 2);
        builder.add_sample(20, 8, false, &[], 1);
        let document = render(&builder.finish());

        let frames = &document["shared"]["frames"];
        assert_eq!(frames.as_array().unwrap().len(), 2);
        let profiles = document["profiles"].as_array().unwrap();
        assert_eq!(profiles.len(), 2);
        // The 10 ns sample comes first even though it arrived second.
        assert_eq!(profiles[0]["weights"], json!([2, 1]));
        assert_eq!(profiles[0]["endValue"], json!(3));
        assert_eq!(profiles[1]["samples"], json!([[]]));
        for profile in profiles {
            let samples = profile["samples"].as_array().unwrap();
            assert_eq!(samples.len(), profile["weights"].as_array().unwrap().len());
        }
    }

    #[test]
    fn empty_profile_has_no_active_profile() {
        let document = render(&Profile::new(Meta::default()));
        assert_eq!(document["profiles"], json!([]));
        assert!(document.get("activeProfileIndex").is_none());
        assert_eq!(document["name"], json!("corsnap profile"));
    }
}
