use super::*;

const NET10: &str = include_str!("descriptor-10.0.12.json");
const NET9: &str = include_str!("descriptor-9.0.22.json");

/// A pointer table long enough for the descriptors' indices.
fn pointers() -> Vec<u64> {
    (0..32u64).map(|i| 0x7f00_0000_0000 + i * 0x1000).collect()
}

#[test]
fn net10s_descriptor_gives_the_code_header_and_the_code_map() {
    let d = Descriptor::parse(NET10, &pointers()).unwrap();
    let layout = choose("10.0.12", Some(&d)).unwrap();
    assert_eq!(layout.header, KNOWN_HEADER);
    let map = layout.code_map.unwrap();
    // ExecutionManagerCodeRangeMapAddress is pointer 20; TopLevelData at 0.
    assert_eq!(map.top_level, 0x7f00_0000_0000 + 20 * 0x1000);
    assert_eq!(map.nibble_version, 2);
    assert_eq!((map.fragment_begin, map.fragment_end, map.fragment_section, map.fragment_next), (8, 16, 24, 0));
    assert_eq!((map.section_flags, map.section_heap_list, map.section_r2r_module), (16, 40, 32));
    assert_eq!((map.heap_start, map.heap_end, map.heap_map_base, map.heap_header_map), (16, 24, 32, 40));
    assert_eq!(map.stub_code_block_last, 0xf);
}

#[test]
fn net9s_descriptor_has_no_code_map_and_the_known_layout_serves() {
    let d = Descriptor::parse(NET9, &pointers()).unwrap();
    let layout = choose("9.0.22", Some(&d)).unwrap();
    assert_eq!(layout.header, KNOWN_HEADER);
    assert_eq!(layout.code_map, None);
}

#[test]
fn runtimes_without_a_descriptor_use_the_known_layout_when_measured() {
    for v in ["8.0.33", "3.1.3", "5.0.17", "10.0.0"] {
        assert_eq!(choose(v, None).unwrap().header, KNOWN_HEADER, "{v}");
    }
    for v in ["11.0.0", "2.1.30", "unknown"] {
        let e = choose(v, None).unwrap_err();
        assert!(e.contains(v), "{e}");
    }
}

#[test]
fn a_future_runtime_is_served_by_its_descriptor_and_refused_without_what_is_needed() {
    // A later runtime that moved a field: the descriptor's word is taken.
    let moved = NET10.replace(r#""NumUnwindInfos":32,"UnwindInfos":36"#, r#""NumUnwindInfos":40,"UnwindInfos":44"#);
    assert_ne!(moved, NET10);
    let d = Descriptor::parse(&moved, &pointers()).unwrap();
    let layout = choose("11.0.1", Some(&d)).unwrap();
    assert_eq!(layout.header.count, 40);
    assert_eq!(layout.header.functions, 44);
    // The same on a version corsnap measured is a contradiction: refused.
    assert!(choose("10.0.12", Some(&d)).is_err());
    // A future runtime whose descriptor lacks the code header: refused.
    let d = Descriptor::parse(NET9, &pointers()).unwrap();
    assert!(choose("11.0.0", Some(&d)).unwrap_err().contains("does not describe its code headers"));
    // An unknown nibble-map scheme keeps the header and drops the map.
    let v3 = NET10.replace(r#""ExecutionManager":2"#, r#""ExecutionManager":"c3""#);
    let d = Descriptor::parse(&v3, &pointers()).unwrap();
    let layout = choose("10.0.12", Some(&d)).unwrap();
    assert_eq!(layout.code_map, None);
}

#[test]
fn the_descriptor_format_variants_parse() {
    let json = r#"{"version":0,"baseline":"empty",
        "types":{"RealCodeHeader":{"!":48,"MethodDesc":[24,"pointer"],"NumUnwindInfos":32,"UnwindInfos":[36,"T_RUNTIME_FUNCTION"]}},
        "globals":{"A":"0x1f","B":[1],"C":["0x10","uint8"],"D":[[0],"pointer"],"E":["x64","string"]},
        "contracts":{"ExecutionManager":"c2","Thread":1},"unknown":{"x":1}}"#;
    let d = Descriptor::parse(json, &[0x100, 0x200]).unwrap();
    assert_eq!(d.field("RealCodeHeader", "MethodDesc"), Ok(24));
    assert_eq!(d.field("RealCodeHeader", "UnwindInfos"), Ok(36));
    assert_eq!(d.globals["A"], 0x1f);
    assert_eq!(d.globals["B"], 0x200);
    assert_eq!(d.globals["C"], 0x10);
    assert_eq!(d.globals["D"], 0x100);
    assert!(!d.globals.contains_key("E"));
    assert_eq!(d.contracts["ExecutionManager"], 2);
    assert!(Descriptor::parse("{not json", &[]).is_err());
}

/// A nibble map as the runtime writes it (`NibbleMapSet`): a nibble for
/// each body's start, and, on version 2, a pointer in every map unit (256
/// bytes of code) that lies wholly inside a body.
fn nibble_map(bodies: &[(u64, u64)], version: u32, units: usize) -> Vec<u32> {
    let mut map = vec![0u32; units];
    for &(start, size) in bodies {
        let index = start / BYTES_PER_BUCKET;
        let nibble = ((start % BYTES_PER_BUCKET) / 4 + 1) as u32;
        let shift = 28 - (index % NIBBLES_PER_UNIT) * 4;
        map[(index / NIBBLES_PER_UNIT) as usize] |= nibble << shift;
        if version >= 2 {
            // Units whose whole 256 bytes lie past the start's unit and
            // before the body's end get a pointer to the start.
            let first_full = (start / 256) + 1;
            let end = start + size;
            let mut unit = first_full;
            while (unit + 1) * 256 <= end {
                map[unit as usize] = (start as u32 & !0xf) + ((start as u32 & 0xf) >> 2) + 9;
                unit += 1;
            }
        }
    }
    map
}

#[test]
fn nibble_map_lookups_find_every_body_start_on_both_versions() {
    // Bodies of different sizes, aligned as the JIT aligns them (16 bytes
    // here; starts must be 4-byte aligned), with a gap in between.
    let bodies = [(0x40u64, 0x30u64), (0x80, 0x600), (0x690, 0x20), (0x800, 0x1200), (0x2000, 0x10)];
    for version in [1, 2] {
        let map = nibble_map(&bodies, version, 64);
        let read = |i: u64| map.get(i as usize).copied();
        for &(start, size) in &bodies {
            for ip in start..start + size {
                assert_eq!(find_method_code(ip, version, read), Some(Some(start)), "v{version} ip {ip:#x}");
            }
        }
        // Before the first body: nothing.
        assert_eq!(find_method_code(0x10, version, read), Some(None), "v{version}");
    }
    // Version 2 reads at most two units: a long body is found from its end
    // through the pointers alone.
    let map = nibble_map(&[(0x100, 0x4000)], 2, 128);
    let reads = std::cell::Cell::new(0);
    let read = |i: u64| {
        reads.set(reads.get() + 1);
        map.get(i as usize).copied()
    };
    assert_eq!(find_method_code(0x40f0, 2, read), Some(Some(0x100)));
    assert!(reads.get() <= 2, "{} reads", reads.get());
}
