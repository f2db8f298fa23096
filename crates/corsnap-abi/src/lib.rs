//! The CoreCLR profiling API as seen from Rust on Linux x64, and the only
//! crate in corsnap that writes `unsafe`.
//!
//! COM on Linux x64 is the System V C calling convention (`STDMETHODCALLTYPE`
//! expands to nothing in the PAL), `WCHAR` is a UTF-16 `u16`, and
//! `LONG`/`ULONG`/`DWORD`/`HRESULT` are 32 bits while the runtime's IDs are
//! pointer-sized. Slot numbers and layouts follow `corprof.idl` and `cor.h`
//! from dotnet/runtime; the compile-time assertions below pin them.
//!
//! What the rest of corsnap gets from here is safe: a [`ProfilerCallbacks`]
//! trait to implement (every entry point from the runtime is wrapped so a
//! panic never unwinds into the CLR), a [`CorProfilerInfo`] handle with typed
//! methods, a [`MetaDataImport`] handle, and [`NativeThread`], a thread that
//! leaves nothing behind to pin the library after the runtime unloads it.

#![deny(unsafe_op_in_unsafe_fn)]
#![cfg(all(target_os = "linux", target_arch = "x86_64"))]

mod callback;
pub mod event_walk;
pub mod first_chance;
pub mod hot_memory;
pub mod il;
mod info;
mod large_blocks;
mod metadata;
mod native_thread;
pub mod os;
pub mod process;
pub mod signal;
pub mod throw_hook;

pub use callback::{class_factory_for, guard, FunctionControl, ProfilerCallbacks, CALLBACK_VTABLE_SLOTS};
pub use info::{il_map, CorProfilerInfo, IlToNativeMap, RuntimeInfo, SnapshotVisit};
pub use metadata::{MetaDataEmit, MetaDataImport, MethodProps, TypeDefProps};
pub use native_thread::{
    current_os_tid, current_uid, peer_credentials, send_all, thread_cpu_time_ns, thread_hash, NativeThread,
    StripedCounter,
};

use std::fmt;

pub type HRESULT = i32;
/// The runtime's opaque IDs are `UINT_PTR`.
pub type ThreadID = usize;
pub type FunctionID = usize;
pub type ModuleID = usize;
pub type ClassID = usize;
pub type ObjectID = usize;
pub type AssemblyID = usize;
pub type AppDomainID = usize;
pub type GCHandleID = usize;
pub type ReJITID = usize;
/// Valid only inside the snapshot callback that hands it out.
pub type FramInfoHandle = usize;
pub type MdToken = u32;
pub type MdTypeDef = u32;
pub type MdMethodDef = u32;

/// A COM GUID in its in-memory layout (the Windows `GUID` struct).
#[repr(C)]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Guid {
    pub data1: u32,
    pub data2: u16,
    pub data3: u16,
    pub data4: [u8; 8],
}

impl Guid {
    /// Parses `xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, with or without braces.
    /// `const` so IIDs are checked at compile time.
    pub const fn parse(s: &str) -> Guid {
        let b = s.as_bytes();
        let start = if b[0] == b'{' { 1 } else { 0 };
        const fn hex(c: u8) -> u64 {
            match c {
                b'0'..=b'9' => (c - b'0') as u64,
                b'a'..=b'f' => (c - b'a' + 10) as u64,
                b'A'..=b'F' => (c - b'A' + 10) as u64,
                _ => panic!("bad hex digit in GUID"),
            }
        }
        const fn field(b: &[u8], from: usize, len: usize) -> u64 {
            let mut v = 0u64;
            let mut i = 0;
            while i < len {
                v = (v << 4) | hex(b[from + i]);
                i += 1;
            }
            v
        }
        assert!(b[start + 8] == b'-' && b[start + 13] == b'-' && b[start + 18] == b'-' && b[start + 23] == b'-');
        let mut data4 = [0u8; 8];
        data4[0] = field(b, start + 19, 2) as u8;
        data4[1] = field(b, start + 21, 2) as u8;
        let mut i = 0;
        while i < 6 {
            data4[2 + i] = field(b, start + 24 + 2 * i, 2) as u8;
            i += 1;
        }
        Guid {
            data1: field(b, start, 8) as u32,
            data2: field(b, start + 9, 4) as u16,
            data3: field(b, start + 14, 4) as u16,
            data4,
        }
    }

    /// The 16 bytes as they lie in memory (what the diagnostics IPC sends).
    pub fn to_bytes_le(&self) -> [u8; 16] {
        let mut out = [0u8; 16];
        out[..4].copy_from_slice(&self.data1.to_le_bytes());
        out[4..6].copy_from_slice(&self.data2.to_le_bytes());
        out[6..8].copy_from_slice(&self.data3.to_le_bytes());
        out[8..].copy_from_slice(&self.data4);
        out
    }
}

impl fmt::Debug for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Guid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.data4;
        write!(
            f,
            "{{{:08X}-{:04X}-{:04X}-{:02X}{:02X}-{:02X}{:02X}{:02X}{:02X}{:02X}{:02X}}}",
            self.data1, self.data2, self.data3, d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]
        )
    }
}

/// Interface IDs, from `corprof.idl` and `cor.h`.
pub mod iid {
    use super::Guid;
    pub const IUNKNOWN: Guid = Guid::parse("00000000-0000-0000-C000-000000000046");
    pub const ICLASSFACTORY: Guid = Guid::parse("00000001-0000-0000-C000-000000000046");
    /// `ICorProfilerCallback` through `ICorProfilerCallback11`, index 0 = version 1.
    pub const ICORPROFILERCALLBACK: [Guid; 11] = [
        Guid::parse("176FBED1-A55C-4796-98CA-A9DA0EF883E7"),
        Guid::parse("8A8CC829-CCF2-49fe-BBAE-0F022228071A"),
        Guid::parse("4FD2ED52-7731-4b8d-9469-03D2CC3086C5"),
        Guid::parse("7B63B2E3-107D-4d48-B2F6-F61E229470D2"),
        Guid::parse("8DFBA405-8C9F-45F8-BFFA-83B14CEF78B5"),
        Guid::parse("FC13DF4B-4448-4F4F-950C-BA8D19D00C36"),
        Guid::parse("F76A2DBA-1D52-4539-866C-2AA518F9EFC3"),
        Guid::parse("5BED9B15-C079-4D47-BFE2-215A140C07E0"),
        Guid::parse("27583EC3-C8F5-482F-8052-194B8CE4705A"),
        Guid::parse("CEC5B60E-C69C-495F-87F6-84D28EE16FFB"),
        Guid::parse("42350846-AAED-47F7-B128-FD0C98881CDE"),
    ];
    /// `ICorProfilerInfo` through `ICorProfilerInfo14`, index 0 = version 1.
    pub const ICORPROFILERINFO: [Guid; 14] = [
        Guid::parse("28B5557D-3F3F-48b4-90B2-5F9EEA2F6C48"),
        Guid::parse("CC0935CD-A518-487d-B0BB-A93214E65478"),
        Guid::parse("B555ED4F-452A-4E54-8B39-B5360BAD32A0"),
        Guid::parse("0d8fdcaa-6257-47bf-b1bf-94dac88466ee"),
        Guid::parse("07602928-CE38-4B83-81E7-74ADAF781214"),
        Guid::parse("F30A070D-BFFB-46A7-B1D8-8781EF7B698A"),
        Guid::parse("9AEECC0D-63E0-4187-8C00-E312F503F663"),
        Guid::parse("C5AC80A6-782E-4716-8044-39598C60CFBF"),
        Guid::parse("008170DB-F8CC-4796-9A51-DC8AA0B47012"),
        Guid::parse("2F1B5152-C869-40C9-AA5F-3ABE026BD720"),
        Guid::parse("06398876-8987-4154-B621-40A00D6E4D04"),
        Guid::parse("27b24ccd-1cb1-47c5-96ee-98190dc30959"),
        Guid::parse("6E6C7EE2-0701-4EC2-9D29-2E8733B66934"),
        Guid::parse("F460E352-D76D-4FE9-835F-F6AF9D6E862D"),
    ];
    pub const IMETADATAIMPORT: Guid = Guid::parse("7DAC8207-D3AE-4c75-9B67-92801A497D44");
    pub const IMETADATAIMPORT2: Guid = Guid::parse("FCE5EFA0-8BBA-4f8e-A036-8F2022B08466");
    pub const IMETADATAEMIT: Guid = Guid::parse("BA3FEE4C-ECB9-4e41-83B7-183FA41CD859");
}

/// HRESULTs the runtime hands us, with names for the ones corsnap explains.
pub mod hr {
    use super::HRESULT;
    pub const S_OK: HRESULT = 0;
    pub const S_FALSE: HRESULT = 1;
    pub const E_NOTIMPL: HRESULT = 0x8000_4001_u32 as i32;
    pub const E_NOINTERFACE: HRESULT = 0x8000_4002_u32 as i32;
    pub const E_POINTER: HRESULT = 0x8000_4003_u32 as i32;
    pub const E_FAIL: HRESULT = 0x8000_4005_u32 as i32;
    pub const E_UNEXPECTED: HRESULT = 0x8000_FFFF_u32 as i32;
    pub const E_OUTOFMEMORY: HRESULT = 0x8007_000E_u32 as i32;
    pub const E_INVALIDARG: HRESULT = 0x8007_0057_u32 as i32;
    pub const CLASS_E_CLASSNOTAVAILABLE: HRESULT = 0x8004_0111_u32 as i32;
    pub const CLASS_E_NOAGGREGATION: HRESULT = 0x8004_0110_u32 as i32;
    pub const ERROR_INSUFFICIENT_BUFFER: HRESULT = 0x8007_007A_u32 as i32;
    // Values from corerror.h; the three the prototype saw (0x80131355,
    // 0x80131363, 0x80131374) anchor the sequence.
    pub const CORPROF_E_FUNCTION_NOT_COMPILED: HRESULT = 0x8013_1350_u32 as i32;
    pub const CORPROF_E_DATAINCOMPLETE: HRESULT = 0x8013_1351_u32 as i32;
    pub const CORPROF_E_NOT_MANAGED_THREAD: HRESULT = 0x8013_1355_u32 as i32;
    pub const CORPROF_E_CALL_ONLY_FROM_INIT: HRESULT = 0x8013_1356_u32 as i32;
    pub const CORPROF_E_NOT_YET_AVAILABLE: HRESULT = 0x8013_135B_u32 as i32;
    pub const CORPROF_E_STACKSNAPSHOT_INVALID_TGT_THREAD: HRESULT = 0x8013_135E_u32 as i32;
    pub const CORPROF_E_STACKSNAPSHOT_UNMANAGED_CTX: HRESULT = 0x8013_135F_u32 as i32;
    pub const CORPROF_E_STACKSNAPSHOT_UNSAFE: HRESULT = 0x8013_1360_u32 as i32;
    pub const CORPROF_E_STACKSNAPSHOT_ABORTED: HRESULT = 0x8013_1361_u32 as i32;
    pub const CORPROF_E_UNSUPPORTED_CALL_SEQUENCE: HRESULT = 0x8013_1363_u32 as i32;
    pub const CORPROF_E_ASYNCHRONOUS_UNSAFE: HRESULT = 0x8013_1364_u32 as i32;
    pub const CORPROF_E_PROFILER_DETACHING: HRESULT = 0x8013_1367_u32 as i32;
    pub const CORPROF_E_PROFILER_NOT_ATTACHABLE: HRESULT = 0x8013_1368_u32 as i32;
    pub const CORPROF_E_UNSUPPORTED_FOR_ATTACHING_PROFILER: HRESULT = 0x8013_136F_u32 as i32;
    pub const CORPROF_E_PROFILER_ALREADY_ACTIVE: HRESULT = 0x8013_136A_u32 as i32;
    pub const CORPROF_E_CALLBACK3_REQUIRED: HRESULT = 0x8013_136E_u32 as i32;
    pub const CORPROF_E_IRREVERSIBLE_INSTRUMENTATION_PRESENT: HRESULT = 0x8013_1370_u32 as i32;
    pub const CORPROF_E_RUNTIME_UNINITIALIZED: HRESULT = 0x8013_1371_u32 as i32;
    pub const CORPROF_E_IMMUTABLE_FLAGS_SET: HRESULT = 0x8013_1372_u32 as i32;
    pub const CORPROF_E_PROFILER_NOT_YET_INITIALIZED: HRESULT = 0x8013_1373_u32 as i32;
    pub const CORPROF_E_INCONSISTENT_WITH_FLAGS: HRESULT = 0x8013_1374_u32 as i32;
    pub const CORPROF_E_SUSPENSION_IN_PROGRESS: HRESULT = 0x8013_1388_u32 as i32;
    pub const DIAGIPC_E_BAD_ENCODING: HRESULT = 0x8013_1384_u32 as i32;
    pub const DIAGIPC_E_UNKNOWN_COMMAND: HRESULT = 0x8013_1385_u32 as i32;
    pub const DIAGIPC_E_UNKNOWN_MAGIC: HRESULT = 0x8013_1386_u32 as i32;
    pub const DIAGIPC_E_NOT_SUPPORTED: HRESULT = 0x8013_1515_u32 as i32;
    /// corerror.h: no metadata record of that name.
    pub const CLDB_E_RECORD_NOTFOUND: HRESULT = 0x8013_1130_u32 as i32;

    /// A short name for a known HRESULT, for logs and error messages.
    pub fn name(hr: HRESULT) -> Option<&'static str> {
        Some(match hr {
            S_OK => "S_OK",
            S_FALSE => "S_FALSE",
            E_NOTIMPL => "E_NOTIMPL",
            E_NOINTERFACE => "E_NOINTERFACE",
            E_POINTER => "E_POINTER",
            E_FAIL => "E_FAIL",
            E_UNEXPECTED => "E_UNEXPECTED",
            E_OUTOFMEMORY => "E_OUTOFMEMORY",
            E_INVALIDARG => "E_INVALIDARG",
            ERROR_INSUFFICIENT_BUFFER => "ERROR_INSUFFICIENT_BUFFER",
            CORPROF_E_FUNCTION_NOT_COMPILED => "CORPROF_E_FUNCTION_NOT_COMPILED",
            CORPROF_E_DATAINCOMPLETE => "CORPROF_E_DATAINCOMPLETE",
            CORPROF_E_NOT_MANAGED_THREAD => "CORPROF_E_NOT_MANAGED_THREAD",
            CORPROF_E_CALL_ONLY_FROM_INIT => "CORPROF_E_CALL_ONLY_FROM_INIT",
            CORPROF_E_STACKSNAPSHOT_INVALID_TGT_THREAD => "CORPROF_E_STACKSNAPSHOT_INVALID_TGT_THREAD",
            CORPROF_E_STACKSNAPSHOT_UNMANAGED_CTX => "CORPROF_E_STACKSNAPSHOT_UNMANAGED_CTX",
            CORPROF_E_STACKSNAPSHOT_UNSAFE => "CORPROF_E_STACKSNAPSHOT_UNSAFE",
            CORPROF_E_STACKSNAPSHOT_ABORTED => "CORPROF_E_STACKSNAPSHOT_ABORTED",
            CORPROF_E_UNSUPPORTED_CALL_SEQUENCE => "CORPROF_E_UNSUPPORTED_CALL_SEQUENCE",
            CORPROF_E_ASYNCHRONOUS_UNSAFE => "CORPROF_E_ASYNCHRONOUS_UNSAFE",
            CORPROF_E_PROFILER_DETACHING => "CORPROF_E_PROFILER_DETACHING",
            CORPROF_E_PROFILER_NOT_ATTACHABLE => "CORPROF_E_PROFILER_NOT_ATTACHABLE",
            CORPROF_E_UNSUPPORTED_FOR_ATTACHING_PROFILER => "CORPROF_E_UNSUPPORTED_FOR_ATTACHING_PROFILER",
            CORPROF_E_IMMUTABLE_FLAGS_SET => "CORPROF_E_IMMUTABLE_FLAGS_SET",
            CORPROF_E_RUNTIME_UNINITIALIZED => "CORPROF_E_RUNTIME_UNINITIALIZED",
            CORPROF_E_INCONSISTENT_WITH_FLAGS => "CORPROF_E_INCONSISTENT_WITH_FLAGS",
            CORPROF_E_NOT_YET_AVAILABLE => "CORPROF_E_NOT_YET_AVAILABLE",
            CORPROF_E_CALLBACK3_REQUIRED => "CORPROF_E_CALLBACK3_REQUIRED",
            CORPROF_E_IRREVERSIBLE_INSTRUMENTATION_PRESENT => "CORPROF_E_IRREVERSIBLE_INSTRUMENTATION_PRESENT",
            CORPROF_E_PROFILER_NOT_YET_INITIALIZED => "CORPROF_E_PROFILER_NOT_YET_INITIALIZED",
            DIAGIPC_E_BAD_ENCODING => "DS_IPC_E_BAD_ENCODING",
            DIAGIPC_E_UNKNOWN_COMMAND => "DS_IPC_E_UNKNOWN_COMMAND",
            DIAGIPC_E_UNKNOWN_MAGIC => "DS_IPC_E_UNKNOWN_MAGIC",
            DIAGIPC_E_NOT_SUPPORTED => "DS_IPC_E_NOTSUPPORTED",
            CLDB_E_RECORD_NOTFOUND => "CLDB_E_RECORD_NOTFOUND",
            CORPROF_E_PROFILER_ALREADY_ACTIVE => "CORPROF_E_PROFILER_ALREADY_ACTIVE",
            CORPROF_E_SUSPENSION_IN_PROGRESS => "CORPROF_E_SUSPENSION_IN_PROGRESS",
            _ => return None,
        })
    }

    /// `0x80131374 (CORPROF_E_INCONSISTENT_WITH_FLAGS)`.
    pub fn describe(hr: HRESULT) -> String {
        match name(hr) {
            Some(n) => format!("0x{:08X} ({n})", hr as u32),
            None => format!("0x{:08X}", hr as u32),
        }
    }
}

/// An error carrying the runtime's HRESULT.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct HResultError(pub HRESULT);

impl fmt::Debug for HResultError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hr::describe(self.0))
    }
}

impl fmt::Display for HResultError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hr::describe(self.0))
    }
}

impl std::error::Error for HResultError {}

pub type HResult<T> = Result<T, HResultError>;

pub(crate) fn check(hr: HRESULT) -> HResult<()> {
    if hr < 0 {
        Err(HResultError(hr))
    } else {
        Ok(())
    }
}

/// `COR_PRF_MONITOR` (low 32 bits of the event mask) and
/// `COR_PRF_HIGH_MONITOR` values from `corprof.idl`.
pub mod event_mask {
    pub const MONITOR_FUNCTION_UNLOADS: u32 = 0x1;
    pub const MONITOR_CLASS_LOADS: u32 = 0x2;
    pub const MONITOR_MODULE_LOADS: u32 = 0x4;
    pub const MONITOR_ASSEMBLY_LOADS: u32 = 0x8;
    pub const MONITOR_APPDOMAIN_LOADS: u32 = 0x10;
    pub const MONITOR_JIT_COMPILATION: u32 = 0x20;
    pub const MONITOR_EXCEPTIONS: u32 = 0x40;
    pub const MONITOR_GC: u32 = 0x80;
    pub const MONITOR_OBJECT_ALLOCATED: u32 = 0x100;
    pub const MONITOR_THREADS: u32 = 0x200;
    pub const MONITOR_SUSPENDS: u32 = 0x1_0000;
    pub const ENABLE_OBJECT_ALLOCATED: u32 = 0x80_0000;
    pub const ENABLE_STACK_SNAPSHOT: u32 = 0x1000_0000;
    /// `COR_PRF_ENABLE_REJIT`: allowed after attach since .NET Core 3.0.
    pub const ENABLE_REJIT: u32 = 0x4_0000;
    /// Everything an attaching profiler may ask for (3.1 through 9; .NET 10
    /// adds the two inlining/optimization bits).
    pub const ALLOWABLE_AFTER_ATTACH: u32 = 0x1005_02FE;
    /// Bits that, once set, forbid detaching (`COR_PRF_MONITOR_IMMUTABLE`).
    pub const MONITOR_IMMUTABLE: u32 = 0xEE98_CC00;
    /// `COR_PRF_HIGH_MONITOR_EVENT_PIPE`, for `SetEventMask2`'s high word.
    pub const HIGH_MONITOR_EVENT_PIPE: u32 = 0x80;
    /// `COR_PRF_HIGH_BASIC_GC`: GC start/finish only, without the costly
    /// moved- and surviving-reference reports of `MONITOR_GC`. Allowed after
    /// attach.
    pub const HIGH_BASIC_GC: u32 = 0x10;
}

/// `COR_PRF_SNAPSHOT_INFO`.
pub mod snapshot {
    pub const DEFAULT: u32 = 0;
    pub const REGISTER_CONTEXT: u32 = 1;
}

/// `COR_PRF_RUNTIME_TYPE`.
pub const COR_PRF_CORE_CLR: u32 = 2;

// Layout facts the rest of this crate relies on.
const _: () = {
    assert!(std::mem::size_of::<Guid>() == 16);
    assert!(std::mem::size_of::<HRESULT>() == 4);
    assert!(std::mem::size_of::<ThreadID>() == 8);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guid_parses_and_prints_in_registry_form() {
        let g = Guid::parse("{8A8CC829-CCF2-49fe-BBAE-0F022228071A}");
        assert_eq!(g.data1, 0x8A8CC829);
        assert_eq!(g.data2, 0xCCF2);
        assert_eq!(g.data3, 0x49FE);
        assert_eq!(g.data4, [0xBB, 0xAE, 0x0F, 0x02, 0x22, 0x28, 0x07, 0x1A]);
        assert_eq!(g.to_string(), "{8A8CC829-CCF2-49FE-BBAE-0F022228071A}");
        assert_eq!(&g.to_bytes_le()[..4], &[0x29, 0xC8, 0x8C, 0x8A]);
    }

    #[test]
    fn hresults_are_named() {
        assert_eq!(
            hr::describe(hr::CORPROF_E_INCONSISTENT_WITH_FLAGS),
            "0x80131374 (CORPROF_E_INCONSISTENT_WITH_FLAGS)"
        );
        assert_eq!(hr::describe(0x8013_9999_u32 as i32), "0x80139999");
    }
}
