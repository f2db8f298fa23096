//! `ICorProfilerInfo*`: the runtime's side, called by corsnap.
//!
//! The runtime implements every version on one object, so the pointer we get
//! from `QueryInterface` for the highest version answers every slot up to that
//! version. [`CorProfilerInfo`] remembers which version it holds and refuses
//! calls to slots beyond it.

use std::ffi::c_void;
use std::ptr::NonNull;

use crate::{check, hr, iid, ClassID, FunctionID, Guid, HResult, HResultError, MdToken, ModuleID, ThreadID, HRESULT};

/// Slot numbers from `corprof.idl` (IUnknown is 0..2).
mod slot {
    pub const QUERY_INTERFACE: usize = 0;
    pub const GET_CLASS_FROM_OBJECT: usize = 3;
    pub const GET_CURRENT_THREAD_ID: usize = 13;
    pub const GET_FUNCTION_FROM_IP: usize = 7;
    pub const EVENT_PIPE_START_SESSION: usize = 101;
    pub const EVENT_PIPE_STOP_SESSION: usize = 103;
    pub const GET_CLASS_ID_INFO: usize = 14;
    pub const GET_THREAD_INFO: usize = 12;
    pub const SET_EVENT_MASK: usize = 16;
    pub const GET_MODULE_INFO: usize = 20;
    pub const GET_MODULE_METADATA: usize = 21;
    pub const FORCE_GC: usize = 28;
    pub const GET_IL_FUNCTION_BODY: usize = 22;
    pub const REQUEST_REJIT: usize = 73;
    pub const REQUEST_REVERT: usize = 74;
    pub const GET_IL_TO_NATIVE_MAPPING: usize = 35;
    pub const DO_STACK_SNAPSHOT: usize = 36;
    pub const GET_FUNCTION_INFO2: usize = 38;
    pub const ENUM_JITED_FUNCTIONS: usize = 57;
    pub const REQUEST_PROFILER_DETACH: usize = 58;
    pub const ENUM_MODULES: usize = 66;
    pub const GET_RUNTIME_INFORMATION: usize = 67;
    pub const ENUM_THREADS: usize = 71;
    pub const SET_EVENT_MASK2: usize = 82;
    pub const GET_NATIVE_CODE_START_ADDRESSES: usize = 90;
    pub const GET_IL_TO_NATIVE_MAPPING3: usize = 91;
    pub const SUSPEND_RUNTIME: usize = 97;
    pub const RESUME_RUNTIME: usize = 98;
}

/// Vtable length of `ICorProfilerInfo` version N is `INFO_VTABLE_LEN[N - 1]`
/// (IUnknown's 3 plus each version's own methods: 33, 21, 14, 10, 2, 1, 3, 3,
/// 3, 6, 2, 7, 3, 3).
pub const INFO_VTABLE_LEN: [usize; 14] = [36, 57, 71, 81, 83, 84, 87, 90, 93, 99, 101, 108, 111, 114];

const _: () = {
    // The slots corsnap calls sit where corprof.idl puts them.
    assert!(slot::DO_STACK_SNAPSHOT == INFO_VTABLE_LEN[0]); // first method of Info2
    assert!(slot::GET_IL_TO_NATIVE_MAPPING == INFO_VTABLE_LEN[0] - 1); // last of Info
    assert!(slot::GET_IL_TO_NATIVE_MAPPING3 == INFO_VTABLE_LEN[7] + 1); // second of Info9
    assert!(slot::ENUM_JITED_FUNCTIONS == INFO_VTABLE_LEN[1]); // first of Info3
    assert!(slot::ENUM_THREADS == INFO_VTABLE_LEN[2]); // first of Info4
    assert!(slot::REQUEST_REJIT == INFO_VTABLE_LEN[2] + 2); // third and fourth of Info4
    assert!(slot::REQUEST_REVERT == INFO_VTABLE_LEN[2] + 3);
    assert!(slot::GET_IL_FUNCTION_BODY == slot::GET_MODULE_METADATA + 1);
    assert!(slot::SET_EVENT_MASK2 == INFO_VTABLE_LEN[3] + 1); // second of Info5
    assert!(slot::GET_NATIVE_CODE_START_ADDRESSES == INFO_VTABLE_LEN[7]); // first of Info9
    assert!(slot::SUSPEND_RUNTIME == INFO_VTABLE_LEN[9] - 2); // last two of Info10
    assert!(slot::RESUME_RUNTIME == INFO_VTABLE_LEN[9] - 1);
    assert!(slot::EVENT_PIPE_START_SESSION == INFO_VTABLE_LEN[10]); // first of Info12
    assert!(slot::EVENT_PIPE_STOP_SESSION == INFO_VTABLE_LEN[10] + 2);
};

/// What `GetRuntimeInformation` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeInfo {
    pub runtime_type: u32,
    pub major: u16,
    pub minor: u16,
    pub build: u16,
    pub qfe: u16,
    pub version_string: String,
}

/// The snapshot callback's view of one frame: the `FunctionID`, or 0 for a
/// run of unmanaged frames, and the frame's instruction pointer (where the
/// thread stands in the leaf frame, a return address in the others). Return
/// `false` to stop the walk.
pub type SnapshotVisit<'a> = dyn FnMut(FunctionID, usize) -> bool + 'a;

/// One entry of a method body's IL-to-native map (`COR_DEBUG_IL_TO_NATIVE_MAP`):
/// the native code from `native_start` to `native_end` (offsets from the
/// body's start, end exclusive) was compiled from the IL at `il_offset`, or
/// is one of the special regions [`il_map::NO_MAPPING`], [`il_map::PROLOG`],
/// [`il_map::EPILOG`].
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IlToNativeMap {
    pub il_offset: u32,
    pub native_start: u32,
    pub native_end: u32,
}

const _: () = {
    assert!(std::mem::size_of::<IlToNativeMap>() == 12);
    assert!(std::mem::align_of::<IlToNativeMap>() == 4);
    assert!(std::mem::offset_of!(IlToNativeMap, native_start) == 4);
    assert!(std::mem::offset_of!(IlToNativeMap, native_end) == 8);
};

/// The special IL offsets of `CorDebugIlToNativeMappingTypes` (cordebug.idl).
pub mod il_map {
    pub const NO_MAPPING: u32 = -1i32 as u32;
    pub const PROLOG: u32 = -2i32 as u32;
    pub const EPILOG: u32 = -3i32 as u32;
}

/// A handle to the runtime's `ICorProfilerInfo` object.
#[derive(Debug, Clone, Copy)]
pub struct CorProfilerInfo {
    this: NonNull<c_void>,
    version: u32,
}

// SAFETY: the runtime's ICorProfilerInfo object is free-threaded: the profiling
// API documents every method as callable from any thread (subject to the
// per-method rules corsnap's agent follows), and the object lives as long as
// the profiler is loaded.
unsafe impl Send for CorProfilerInfo {}
// SAFETY: as above; the handle itself is an immutable pointer and a number.
unsafe impl Sync for CorProfilerInfo {}

type QueryInterfaceFn = unsafe extern "C" fn(*mut c_void, *const Guid, *mut *mut c_void) -> HRESULT;

/// Calls `QueryInterface` on any COM pointer.
///
/// # Safety
/// `this` must be a live COM object.
pub(crate) unsafe fn query_interface(this: NonNull<c_void>, iid: &Guid) -> HResult<NonNull<c_void>> {
    // SAFETY: a COM object starts with its vtable pointer, slot 0 is QI.
    unsafe {
        let vtbl = *(this.as_ptr() as *const *const *const c_void);
        let qi: QueryInterfaceFn = std::mem::transmute(*vtbl.add(slot::QUERY_INTERFACE));
        let mut out = std::ptr::null_mut();
        check(qi(this.as_ptr(), iid, &mut out))?;
        NonNull::new(out).ok_or(HResultError(hr::E_POINTER))
    }
}

/// Calls `Release` on any COM pointer.
///
/// # Safety
/// `this` must be a live COM object whose reference we own.
pub(crate) unsafe fn release(this: NonNull<c_void>) {
    // SAFETY: slot 2 of every COM vtable is Release.
    unsafe {
        let vtbl = *(this.as_ptr() as *const *const *const c_void);
        let release: unsafe extern "C" fn(*mut c_void) -> u32 = std::mem::transmute(*vtbl.add(2));
        release(this.as_ptr());
    }
}

/// Reads vtable slot `index` of a COM pointer as a function of type `F`.
///
/// # Safety
/// `F` must be the slot's true signature and `index` inside the vtable.
unsafe fn vtable_fn<F: Copy>(this: NonNull<c_void>, index: usize) -> F {
    // SAFETY: per the caller's contract.
    unsafe {
        let vtbl = *(this.as_ptr() as *const *const *const c_void);
        let f = *vtbl.add(index);
        std::mem::transmute_copy::<*const c_void, F>(&f)
    }
}

/// `ICorProfiler*Enum` share one shape: Skip, Reset, Clone, GetCount, Next.
fn drain_enum(enumerator: NonNull<c_void>) -> HResult<Vec<usize>> {
    type GetCount = unsafe extern "C" fn(*mut c_void, *mut u32) -> HRESULT;
    type Next = unsafe extern "C" fn(*mut c_void, u32, *mut usize, *mut u32) -> HRESULT;
    let mut ids = Vec::new();
    // SAFETY: `enumerator` is a live enumerator we own; slots 6 and 7 are
    // GetCount and Next in every ICorProfiler*Enum.
    let result = unsafe {
        let get_count: GetCount = vtable_fn(enumerator, 6);
        let next: Next = vtable_fn(enumerator, 7);
        let mut count = 0u32;
        match check(get_count(enumerator.as_ptr(), &mut count)) {
            Err(e) => Err(e),
            Ok(()) => {
                ids.resize(count as usize, 0);
                let mut fetched = 0u32;
                let hr = next(enumerator.as_ptr(), count, ids.as_mut_ptr(), &mut fetched);
                ids.truncate(fetched as usize);
                check(hr)
            }
        }
    };
    // SAFETY: we own the enumerator's reference.
    unsafe { release(enumerator) };
    result.map(|()| ids)
}

impl CorProfilerInfo {
    /// Queries the runtime's `IUnknown` for the highest `ICorProfilerInfo` it has.
    ///
    /// # Safety
    /// `unknown` must be the pointer the runtime passed to `Initialize` or
    /// `InitializeForAttach`.
    pub(crate) unsafe fn from_unknown(unknown: *mut c_void) -> HResult<CorProfilerInfo> {
        let unknown = NonNull::new(unknown).ok_or(HResultError(hr::E_POINTER))?;
        for version in (1..=iid::ICORPROFILERINFO.len()).rev() {
            // SAFETY: `unknown` is live per the caller's contract.
            if let Ok(this) = unsafe { query_interface(unknown, &iid::ICORPROFILERINFO[version - 1]) } {
                // The reference QI added is kept for the profiler's lifetime:
                // the runtime releases the Info object itself on unload.
                return Ok(CorProfilerInfo { this, version: version as u32 });
            }
        }
        Err(HResultError(hr::E_NOINTERFACE))
    }

    /// The highest `ICorProfilerInfo` version the runtime gave us.
    pub fn version(&self) -> u32 {
        self.version
    }

    fn require(&self, slot: usize) -> HResult<()> {
        if slot < INFO_VTABLE_LEN[self.version as usize - 1] {
            Ok(())
        } else {
            Err(HResultError(hr::E_NOTIMPL))
        }
    }

    /// Reads a slot after checking the runtime has it.
    ///
    /// # Safety
    /// `F` must be the slot's signature from corprof.idl.
    unsafe fn method<F: Copy>(&self, slot: usize) -> HResult<F> {
        self.require(slot)?;
        // SAFETY: slot is inside this version's vtable; F per caller.
        Ok(unsafe { vtable_fn(self.this, slot) })
    }

    fn raw(&self) -> *mut c_void {
        self.this.as_ptr()
    }

    pub fn set_event_mask(&self, mask: u32) -> HResult<()> {
        // SAFETY: SetEventMask(DWORD).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, u32) -> HRESULT = self.method(slot::SET_EVENT_MASK)?;
            check(f(self.raw(), mask))
        }
    }

    pub fn set_event_mask2(&self, low: u32, high: u32) -> HResult<()> {
        // SAFETY: SetEventMask2(DWORD, DWORD).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, u32, u32) -> HRESULT = self.method(slot::SET_EVENT_MASK2)?;
            check(f(self.raw(), low, high))
        }
    }

    /// The OS thread id (`gettid`) a managed thread runs on.
    pub fn get_thread_info(&self, thread: ThreadID) -> HResult<u32> {
        let mut os_tid = 0u32;
        // SAFETY: GetThreadInfo(ThreadID, DWORD*).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, ThreadID, *mut u32) -> HRESULT =
                self.method(slot::GET_THREAD_INFO)?;
            check(f(self.raw(), thread, &mut os_tid))?;
        }
        Ok(os_tid)
    }

    /// The class of an object. Valid only inside the callback that handed
    /// out the `ObjectID` (a collection may move the object afterwards).
    pub fn get_class_from_object(&self, object: crate::ObjectID) -> HResult<ClassID> {
        let mut class = 0usize;
        // SAFETY: GetClassFromObject(ObjectID, ClassID*).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, usize, *mut ClassID) -> HRESULT =
                self.method(slot::GET_CLASS_FROM_OBJECT)?;
            check(f(self.raw(), object, &mut class))?;
        }
        Ok(class)
    }

    /// The managed function containing `ip`, or an error for code the
    /// runtime does not manage.
    pub fn get_function_from_ip(&self, ip: usize) -> HResult<FunctionID> {
        let mut function = 0usize;
        // SAFETY: GetFunctionFromIP(LPCBYTE, FunctionID*).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, usize, *mut FunctionID) -> HRESULT =
                self.method(slot::GET_FUNCTION_FROM_IP)?;
            check(f(self.raw(), ip, &mut function))?;
        }
        Ok(function)
    }

    /// The IL-to-native map of the code body starting at `code_start`
    /// (Info9's `GetILToNativeMapping3`: the right one for that tier).
    pub fn get_il_to_native_mapping3(&self, code_start: usize) -> HResult<Vec<IlToNativeMap>> {
        type F = unsafe extern "C" fn(*mut c_void, usize, u32, *mut u32, *mut IlToNativeMap) -> HRESULT;
        self.il_to_native_map(|len, count, map| {
            // SAFETY: GetILToNativeMapping3(UINT_PTR, ULONG32 cMap,
            // ULONG32*, COR_DEBUG_IL_TO_NATIVE_MAP[]) with `len` entries.
            unsafe {
                let f: F = self.method(slot::GET_IL_TO_NATIVE_MAPPING3)?;
                Ok(f(self.raw(), code_start, len, count, map))
            }
        })
    }

    /// The IL-to-native map of `function`'s default code body (Info1).
    pub fn get_il_to_native_mapping(&self, function: FunctionID) -> HResult<Vec<IlToNativeMap>> {
        type F = unsafe extern "C" fn(*mut c_void, FunctionID, u32, *mut u32, *mut IlToNativeMap) -> HRESULT;
        self.il_to_native_map(|len, count, map| {
            // SAFETY: GetILToNativeMapping(FunctionID, ULONG32 cMap,
            // ULONG32*, COR_DEBUG_IL_TO_NATIVE_MAP[]) with `len` entries.
            unsafe {
                let f: F = self.method(slot::GET_IL_TO_NATIVE_MAPPING)?;
                Ok(f(self.raw(), function, len, count, map))
            }
        })
    }

    /// Calls a `GetILToNativeMapping*` (given the array's length, the count
    /// out-parameter and the array) until the array is big enough.
    fn il_to_native_map(
        &self,
        mut call: impl FnMut(u32, *mut u32, *mut IlToNativeMap) -> HResult<HRESULT>,
    ) -> HResult<Vec<IlToNativeMap>> {
        let mut map = vec![IlToNativeMap::default(); 64];
        loop {
            let mut count = 0u32;
            check(call(map.len() as u32, &mut count, map.as_mut_ptr())?)?;
            if (count as usize) <= map.len() {
                map.truncate(count as usize);
                return Ok(map);
            }
            if count > 1 << 20 {
                return Err(HResultError(hr::E_FAIL));
            }
            map.resize(count as usize, IlToNativeMap::default());
        }
    }

    /// Starts an in-process EventPipe session (Info12, .NET 5+) whose events
    /// arrive through `ICorProfilerCallback10::EventPipeEventDelivered`.
    /// `providers`: (name, keywords, level).
    pub fn event_pipe_start_session(&self, providers: &[(&str, u64, u32)]) -> HResult<u64> {
        #[repr(C)]
        struct ProviderConfig {
            name: *const u16,
            keywords: u64,
            level: u32,
            filter_data: *const u16,
        }
        const _: () = assert!(std::mem::size_of::<ProviderConfig>() == 32);
        let names: Vec<Vec<u16>> = providers.iter().map(|(n, _, _)| n.encode_utf16().chain([0]).collect()).collect();
        let configs: Vec<ProviderConfig> = providers
            .iter()
            .zip(&names)
            .map(|(&(_, keywords, level), name)| ProviderConfig {
                name: name.as_ptr(),
                keywords,
                level,
                filter_data: std::ptr::null(),
            })
            .collect();
        let mut session = 0u64;
        // SAFETY: EventPipeStartSession(UINT32, COR_PRF_EVENTPIPE_PROVIDER_CONFIG[],
        // BOOL requestRundown, EVENTPIPE_SESSION*); the names outlive the call.
        unsafe {
            type F = unsafe extern "C" fn(*mut c_void, u32, *const ProviderConfig, i32, *mut u64) -> HRESULT;
            let f: F = self.method(slot::EVENT_PIPE_START_SESSION)?;
            check(f(self.raw(), configs.len() as u32, configs.as_ptr(), 0, &mut session))?;
        }
        Ok(session)
    }

    pub fn event_pipe_stop_session(&self, session: u64) -> HResult<()> {
        // SAFETY: EventPipeStopSession(EVENTPIPE_SESSION).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, u64) -> HRESULT = self.method(slot::EVENT_PIPE_STOP_SESSION)?;
            check(f(self.raw(), session))
        }
    }

    /// The calling thread's `ThreadID` (an error on threads the runtime does
    /// not manage).
    pub fn get_current_thread_id(&self) -> HResult<ThreadID> {
        let mut thread = 0usize;
        // SAFETY: GetCurrentThreadID(ThreadID*).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, *mut ThreadID) -> HRESULT =
                self.method(slot::GET_CURRENT_THREAD_ID)?;
            check(f(self.raw(), &mut thread))?;
        }
        Ok(thread)
    }

    /// `(module, typedef token)` of a class.
    pub fn get_class_id_info(&self, class: ClassID) -> HResult<(ModuleID, MdToken)> {
        let (mut module, mut token) = (0usize, 0u32);
        // SAFETY: GetClassIDInfo(ClassID, ModuleID*, mdTypeDef*).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, ClassID, *mut ModuleID, *mut MdToken) -> HRESULT =
                self.method(slot::GET_CLASS_ID_INFO)?;
            check(f(self.raw(), class, &mut module, &mut token))?;
        }
        Ok((module, token))
    }

    /// `(class, module, method token)` of a function, with no frame info (so
    /// it is valid outside a snapshot callback).
    pub fn get_function_info2(&self, function: FunctionID) -> HResult<(ClassID, ModuleID, MdToken)> {
        let (mut class, mut module, mut token) = (0usize, 0usize, 0u32);
        let mut type_args = 0u32;
        // SAFETY: GetFunctionInfo2(FunctionID, COR_PRF_FRAME_INFO, ClassID*,
        // ModuleID*, mdToken*, ULONG32, ULONG32*, ClassID[]); zero type args
        // requested, so the array may be null.
        unsafe {
            type F = unsafe extern "C" fn(
                *mut c_void,
                FunctionID,
                usize,
                *mut ClassID,
                *mut ModuleID,
                *mut MdToken,
                u32,
                *mut u32,
                *mut ClassID,
            ) -> HRESULT;
            let f: F = self.method(slot::GET_FUNCTION_INFO2)?;
            check(f(
                self.raw(),
                function,
                0,
                &mut class,
                &mut module,
                &mut token,
                0,
                &mut type_args,
                std::ptr::null_mut(),
            ))?;
        }
        Ok((class, module, token))
    }

    /// The file path a module was loaded from.
    pub fn get_module_path(&self, module: ModuleID) -> HResult<String> {
        self.get_module_info(module).map(|(_, path)| path)
    }

    /// Where a module's image is mapped, and the path it was loaded from.
    pub fn get_module_info(&self, module: ModuleID) -> HResult<(u64, String)> {
        type F =
            unsafe extern "C" fn(*mut c_void, ModuleID, *mut *const u8, u32, *mut u32, *mut u16, *mut usize) -> HRESULT;
        let mut buf = vec![0u16; 512];
        loop {
            let (mut base, mut len, mut assembly) = (std::ptr::null(), 0u32, 0usize);
            // SAFETY: GetModuleInfo with a buffer of `buf.len()` UTF-16 units.
            let hr = unsafe {
                let f: F = self.method(slot::GET_MODULE_INFO)?;
                f(self.raw(), module, &mut base, buf.len() as u32, &mut len, buf.as_mut_ptr(), &mut assembly)
            };
            if hr == hr::ERROR_INSUFFICIENT_BUFFER && (len as usize) > buf.len() && len < 65536 {
                buf.resize(len as usize, 0);
                continue;
            }
            check(hr)?;
            return Ok((base as u64, crate::metadata::utf16_until_nul(&buf[..(len as usize).min(buf.len())])));
        }
    }

    /// Opens a module's metadata for reading (`IMetaDataImport2`, falling
    /// back to `IMetaDataImport`).
    pub fn get_module_metadata(&self, module: ModuleID) -> HResult<crate::MetaDataImport> {
        type F = unsafe extern "C" fn(*mut c_void, ModuleID, u32, *const Guid, *mut *mut c_void) -> HRESULT;
        const OF_READ: u32 = 0;
        for (iid, has_generics) in [(&iid::IMETADATAIMPORT2, true), (&iid::IMETADATAIMPORT, false)] {
            let mut out = std::ptr::null_mut();
            // SAFETY: GetModuleMetaData(ModuleID, DWORD, REFIID, IUnknown**).
            let hr = unsafe {
                let f: F = self.method(slot::GET_MODULE_METADATA)?;
                f(self.raw(), module, OF_READ, iid, &mut out)
            };
            if hr == hr::S_OK {
                if let Some(ptr) = NonNull::new(out) {
                    // SAFETY: a fresh reference to the interface we asked for.
                    return Ok(unsafe { crate::MetaDataImport::from_raw(ptr, has_generics) });
                }
            }
            if hr < 0 && hr != hr::E_NOINTERFACE {
                return Err(HResultError(hr));
            }
        }
        Err(HResultError(hr::E_NOINTERFACE))
    }

    /// Opens a module's metadata for writing (`IMetaDataEmit`).
    pub fn get_module_metadata_for_emit(&self, module: ModuleID) -> HResult<crate::MetaDataEmit> {
        type F = unsafe extern "C" fn(*mut c_void, ModuleID, u32, *const Guid, *mut *mut c_void) -> HRESULT;
        const OF_READ_WRITE: u32 = 1;
        let mut out = std::ptr::null_mut();
        // SAFETY: GetModuleMetaData(ModuleID, DWORD, REFIID, IUnknown**).
        unsafe {
            let f: F = self.method(slot::GET_MODULE_METADATA)?;
            check(f(self.raw(), module, OF_READ_WRITE, &iid::IMETADATAEMIT, &mut out))?;
        }
        let ptr = NonNull::new(out).ok_or(HResultError(hr::E_POINTER))?;
        // SAFETY: a fresh reference to the interface we asked for.
        Ok(unsafe { crate::MetaDataEmit::from_raw(ptr) })
    }

    /// A method's IL body as the module holds it (header first), copied.
    pub fn get_il_function_body(&self, module: ModuleID, method: MdToken) -> HResult<Vec<u8>> {
        type F = unsafe extern "C" fn(*mut c_void, ModuleID, MdToken, *mut *const u8, *mut u32) -> HRESULT;
        let (mut body, mut size) = (std::ptr::null(), 0u32);
        // SAFETY: GetILFunctionBody(ModuleID, mdMethodDef, LPCBYTE*, ULONG*);
        // the body lives as long as the module, and is copied at once.
        unsafe {
            let f: F = self.method(slot::GET_IL_FUNCTION_BODY)?;
            check(f(self.raw(), module, method, &mut body, &mut size))?;
            if body.is_null() {
                return Err(HResultError(hr::E_POINTER));
            }
            Ok(std::slice::from_raw_parts(body, size as usize).to_vec())
        }
    }

    /// Asks the runtime to compile `methods` (each in its module) again, with
    /// the bodies the profiler gives in `GetReJITParameters` (Info4), in one
    /// request: one suspension. Suspends the runtime: never from a callback.
    pub fn request_rejit(&self, methods: &[(ModuleID, MdToken)]) -> HResult<()> {
        type F = unsafe extern "C" fn(*mut c_void, u32, *const ModuleID, *const MdToken) -> HRESULT;
        let (modules, tokens): (Vec<ModuleID>, Vec<MdToken>) = methods.iter().copied().unzip();
        // SAFETY: RequestReJIT(ULONG, ModuleID[], mdMethodDef[]), both
        // arrays of the count given, alive for the call.
        unsafe {
            let f: F = self.method(slot::REQUEST_REJIT)?;
            check(f(self.raw(), methods.len() as u32, modules.as_ptr(), tokens.as_ptr()))
        }
    }

    /// Puts `methods` (each in its module) back to their original code
    /// (Info4). The first failure, of the call or of a method, is the error.
    pub fn request_revert(&self, methods: &[(ModuleID, MdToken)]) -> HResult<()> {
        type F = unsafe extern "C" fn(*mut c_void, u32, *const ModuleID, *const MdToken, *mut HRESULT) -> HRESULT;
        let (modules, tokens): (Vec<ModuleID>, Vec<MdToken>) = methods.iter().copied().unzip();
        let mut statuses: Vec<HRESULT> = vec![0; methods.len()];
        // SAFETY: RequestRevert(ULONG, ModuleID[], mdMethodDef[], HRESULT[]),
        // the three arrays of the count given, alive for the call.
        unsafe {
            let f: F = self.method(slot::REQUEST_REVERT)?;
            check(f(self.raw(), methods.len() as u32, modules.as_ptr(), tokens.as_ptr(), statuses.as_mut_ptr()))?;
        }
        statuses.into_iter().try_for_each(check)
    }

    /// Walks a thread's managed stack, calling `visit` per frame, leaf first.
    ///
    /// `thread == 0` walks the calling thread (a synchronous walk). On Linux
    /// another thread can be walked only while the runtime is suspended with
    /// [`suspend_runtime`](Self::suspend_runtime); otherwise the runtime
    /// answers `E_NOTIMPL`. `visit` runs inside the runtime's walk: it must not
    /// block, take a lock a suspended thread could hold, or allocate.
    pub fn do_stack_snapshot(&self, thread: ThreadID, visit: &mut SnapshotVisit<'_>) -> HRESULT {
        type Callback = unsafe extern "C" fn(FunctionID, usize, usize, u32, *mut u8, *mut c_void) -> HRESULT;
        type F = unsafe extern "C" fn(*mut c_void, ThreadID, Callback, u32, *mut c_void, *mut u8, u32) -> HRESULT;

        unsafe extern "C" fn trampoline(
            function: FunctionID,
            ip: usize,
            _frame_info: usize,
            _context_size: u32,
            _context: *mut u8,
            client_data: *mut c_void,
        ) -> HRESULT {
            // SAFETY: `client_data` is the `&mut &mut SnapshotVisit` passed
            // below, alive for the whole DoStackSnapshot call.
            let visit = unsafe { &mut *(client_data as *mut &mut SnapshotVisit<'_>) };
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| visit(function, ip))) {
                Ok(true) => hr::S_OK,
                Ok(false) | Err(_) => hr::S_FALSE,
            }
        }

        let mut visit_ref: &mut SnapshotVisit<'_> = visit;
        // SAFETY: DoStackSnapshot(ThreadID, StackSnapshotCallback*, ULONG32,
        // void*, BYTE[], ULONG32); no seed context.
        unsafe {
            let f: F = match self.method(slot::DO_STACK_SNAPSHOT) {
                Ok(f) => f,
                Err(e) => return e.0,
            };
            f(
                self.raw(),
                thread,
                trampoline,
                crate::snapshot::DEFAULT,
                &mut visit_ref as *mut &mut SnapshotVisit<'_> as *mut c_void,
                std::ptr::null_mut(),
                0,
            )
        }
    }

    fn call_no_args(&self, slot: usize) -> HResult<()> {
        // SAFETY: the slots passed here take no arguments besides `this`.
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void) -> HRESULT = self.method(slot)?;
            check(f(self.raw()))
        }
    }

    /// Stops every managed thread at a safe point (Info10). Call only from a
    /// thread that never ran managed code, never while already suspended, and
    /// resume from the same thread.
    pub fn suspend_runtime(&self) -> HResult<()> {
        self.call_no_args(slot::SUSPEND_RUNTIME)
    }

    pub fn resume_runtime(&self) -> HResult<()> {
        self.call_no_args(slot::RESUME_RUNTIME)
    }

    /// Forces a full collection. Call only from a thread that never ran
    /// managed code and is not inside a callback.
    pub fn force_gc(&self) -> HResult<()> {
        self.call_no_args(slot::FORCE_GC)
    }

    pub fn request_profiler_detach(&self, expected_completion_ms: u32) -> HResult<()> {
        // SAFETY: RequestProfilerDetach(DWORD).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, u32) -> HRESULT = self.method(slot::REQUEST_PROFILER_DETACH)?;
            check(f(self.raw(), expected_completion_ms))
        }
    }

    fn enumerate(&self, slot: usize) -> HResult<Vec<usize>> {
        let mut out = std::ptr::null_mut();
        // SAFETY: EnumThreads/EnumModules(ICorProfiler*Enum**).
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> HRESULT = self.method(slot)?;
            check(f(self.raw(), &mut out))?;
        }
        drain_enum(NonNull::new(out).ok_or(HResultError(hr::E_POINTER))?)
    }

    /// Every live managed thread. Safe while the runtime is suspended by us.
    pub fn enum_threads(&self) -> HResult<Vec<ThreadID>> {
        self.enumerate(slot::ENUM_THREADS)
    }

    /// Like [`enum_threads`](Self::enum_threads), but into `out`, which is
    /// never grown past its capacity: the sampler calls this with the runtime
    /// suspended, where it must not allocate. Threads beyond the capacity are
    /// left out.
    pub fn enum_threads_into(&self, out: &mut Vec<ThreadID>) -> HResult<()> {
        type GetCount = unsafe extern "C" fn(*mut c_void, *mut u32) -> HRESULT;
        type Next = unsafe extern "C" fn(*mut c_void, u32, *mut usize, *mut u32) -> HRESULT;
        out.clear();
        let mut raw = std::ptr::null_mut();
        // SAFETY: EnumThreads(ICorProfilerThreadEnum**), then GetCount (slot
        // 6) and Next (slot 7); `Next` writes at most `room` ids into
        // `out`'s spare capacity, and only `fetched` of them are kept.
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> HRESULT = self.method(slot::ENUM_THREADS)?;
            check(f(self.raw(), &mut raw))?;
            let e = NonNull::new(raw).ok_or(HResultError(hr::E_POINTER))?;
            let get_count: GetCount = vtable_fn(e, 6);
            let next: Next = vtable_fn(e, 7);
            let mut count = 0u32;
            let mut result = check(get_count(e.as_ptr(), &mut count));
            if result.is_ok() {
                let room = (count as usize).min(out.capacity()) as u32;
                let mut fetched = 0u32;
                result = check(next(e.as_ptr(), room, out.as_mut_ptr(), &mut fetched));
                if result.is_ok() {
                    out.set_len((fetched.min(room)) as usize);
                }
            }
            release(e);
            result
        }
    }

    /// Every loaded module. Never call while the runtime is suspended.
    pub fn enum_modules(&self) -> HResult<Vec<ModuleID>> {
        self.enumerate(slot::ENUM_MODULES)
    }

    /// Where each native code version of `function` (its tiers, for the
    /// IL the runtime started with) begins (Info9).
    pub fn get_native_code_start_addresses(&self, function: FunctionID) -> HResult<Vec<u64>> {
        self.get_native_code_start_addresses_of(function, 0)
    }

    /// The same, for the version `rejit_id` of its IL (0: the original; a
    /// ReJIT's, as `ReJITCompilationFinished` names it).
    pub fn get_native_code_start_addresses_of(&self, function: FunctionID, rejit_id: usize) -> HResult<Vec<u64>> {
        type F = unsafe extern "C" fn(*mut c_void, FunctionID, usize, u32, *mut u32, *mut usize) -> HRESULT;
        let mut starts = [0usize; 16];
        let mut count = 0u32;
        // SAFETY: GetNativeCodeStartAddresses(FunctionID, ReJITID,
        // ULONG32 cCodeStartAddresses, ULONG32 *pcCodeStartAddresses,
        // UINT_PTR codeStartAddresses[]).
        unsafe {
            let f: F = self.method(slot::GET_NATIVE_CODE_START_ADDRESSES)?;
            check(f(self.raw(), function, rejit_id, starts.len() as u32, &mut count, starts.as_mut_ptr()))?;
        }
        let n = (count as usize).min(starts.len());
        Ok(starts[..n].iter().map(|&a| a as u64).collect())
    }

    /// Every JIT-compiled function (not ReadyToRun code).
    pub fn enum_jited_functions(&self) -> HResult<Vec<FunctionID>> {
        // COR_PRF_FUNCTION is {FunctionID, ReJITID}: two words per entry.
        type Next = unsafe extern "C" fn(*mut c_void, u32, *mut [usize; 2], *mut u32) -> HRESULT;
        type GetCount = unsafe extern "C" fn(*mut c_void, *mut u32) -> HRESULT;
        let mut out = std::ptr::null_mut();
        // SAFETY: EnumJITedFunctions(ICorProfilerFunctionEnum**), then
        // GetCount (slot 6) and Next (slot 7) of the enumerator.
        unsafe {
            let f: unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> HRESULT =
                self.method(slot::ENUM_JITED_FUNCTIONS)?;
            check(f(self.raw(), &mut out))?;
            let e = NonNull::new(out).ok_or(HResultError(hr::E_POINTER))?;
            let get_count: GetCount = vtable_fn(e, 6);
            let next: Next = vtable_fn(e, 7);
            let mut count = 0u32;
            let mut entries = Vec::new();
            let mut result = check(get_count(e.as_ptr(), &mut count));
            if result.is_ok() {
                entries.resize(count as usize, [0usize; 2]);
                let mut fetched = 0u32;
                result = check(next(e.as_ptr(), count, entries.as_mut_ptr(), &mut fetched));
                entries.truncate(fetched as usize);
            }
            release(e);
            result.map(|()| entries.into_iter().map(|[f, _]| f).collect())
        }
    }

    pub fn get_runtime_information(&self) -> HResult<RuntimeInfo> {
        type F = unsafe extern "C" fn(
            *mut c_void,
            *mut u16,
            *mut u32,
            *mut u16,
            *mut u16,
            *mut u16,
            *mut u16,
            u32,
            *mut u32,
            *mut u16,
        ) -> HRESULT;
        let (mut instance, mut runtime_type) = (0u16, 0u32);
        let (mut major, mut minor, mut build, mut qfe) = (0u16, 0u16, 0u16, 0u16);
        let mut buf = [0u16; 64];
        let mut len = 0u32;
        // SAFETY: GetRuntimeInformation with a 64-unit buffer.
        unsafe {
            let f: F = self.method(slot::GET_RUNTIME_INFORMATION)?;
            check(f(
                self.raw(),
                &mut instance,
                &mut runtime_type,
                &mut major,
                &mut minor,
                &mut build,
                &mut qfe,
                buf.len() as u32,
                &mut len,
                buf.as_mut_ptr(),
            ))?;
        }
        Ok(RuntimeInfo {
            runtime_type,
            major,
            minor,
            build,
            qfe,
            version_string: crate::metadata::utf16_until_nul(&buf[..(len as usize).min(buf.len())]),
        })
    }
}
