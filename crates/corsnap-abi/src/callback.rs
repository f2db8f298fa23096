//! Our side of COM: the `ICorProfilerCallback11` object the runtime calls,
//! and the class factory that hands it out.
//!
//! Every slot of `ICorProfilerCallback` through `ICorProfilerCallback11` is
//! listed in `corprof.idl` order. Slots corsnap does not use point at one stub
//! that returns `S_OK`: under the System V ABI the caller owns the argument
//! registers and the stack, so a callee that ignores trailing arguments is
//! sound. Every trampoline runs the Rust side under [`guard`], so a panic
//! becomes an error HRESULT instead of unwinding into the CLR.

use std::ffi::c_void;
use std::mem::offset_of;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::info::CorProfilerInfo;
use crate::{hr, iid, ClassID, FunctionID, Guid, HResult, MdToken, ModuleID, ObjectID, ThreadID, HRESULT};

/// A slot corsnap does not implement.
pub type Ignored = unsafe extern "C" fn(*mut c_void) -> HRESULT;
/// A callback with no arguments besides `this`.
pub type ThisOnly = unsafe extern "C" fn(*mut c_void) -> HRESULT;

/// IUnknown (3) + Callback (69) + Callback2..11 (8+3+6+1+1+1+2+1+2+1).
pub const CALLBACK_VTABLE_SLOTS: usize = 98;

/// What corsnap implements. Every method has a harmless default; the runtime
/// only calls what the event mask asks for.
pub trait ProfilerCallbacks: Send + Sync + Sized + 'static {
    /// Builds the object the runtime will call (from `CreateInstance`).
    fn create() -> Self;
    /// Start-up load. A failing HRESULT makes the runtime unload us.
    fn initialize(&self, _info: CorProfilerInfo) -> HRESULT {
        hr::S_OK
    }
    /// Attach through the diagnostics socket, with the client's bytes.
    fn initialize_for_attach(&self, _info: CorProfilerInfo, _client_data: &[u8]) -> HRESULT {
        hr::E_NOTIMPL
    }
    fn profiler_attach_complete(&self) {}
    fn profiler_detach_succeeded(&self) {}
    fn shutdown(&self) {}
    fn module_load_finished(&self, _module: ModuleID, _status: HRESULT) {}
    fn module_unload_started(&self, _module: ModuleID) {}
    fn class_load_finished(&self, _class: ClassID, _status: HRESULT) {}
    fn jit_compilation_finished(&self, _function: FunctionID, _status: HRESULT, _safe_to_block: bool) {}
    fn thread_created(&self, _thread: ThreadID) {}
    fn thread_destroyed(&self, _thread: ThreadID) {}
    fn thread_assigned_to_os_thread(&self, _thread: ThreadID, _os_tid: u32) {}
    fn thread_name_changed(&self, _thread: ThreadID, _name: &[u16]) {}
    fn exception_thrown(&self, _object: ObjectID) {}
    /// The runtime compiles `method` again, as asked by `RequestReJIT`: the
    /// body to compile goes to `control` (no body: the original IL).
    fn get_rejit_parameters(&self, _module: ModuleID, _method: MdToken, _control: FunctionControl) {}
    /// A method asked to be compiled again was (`rejit_id`: its new
    /// version), before the runtime installs its code.
    fn rejit_compilation_finished(&self, _function: FunctionID, _rejit_id: usize, _status: HRESULT) {}
    /// A method asked to be compiled again could not be.
    fn rejit_error(&self, _module: ModuleID, _method: MdToken, _status: HRESULT) {}
    fn garbage_collection_started(&self, _generations: &[bool], _reason: u32) {}
    fn garbage_collection_finished(&self) {}
    /// An event of our in-process EventPipe session (Callback10), with the
    /// writing thread's stack as instruction pointers, leaf first.
    fn event_pipe_event_delivered(
        &self,
        _event_id: u32,
        _version: u32,
        _payload: &[u8],
        _thread: ThreadID,
        _stack: &[usize],
    ) {
    }
}

/// `ICorProfilerFunctionControl`, good for one `GetReJITParameters` call.
#[derive(Debug, Clone, Copy)]
pub struct FunctionControl(NonNull<c_void>);

impl FunctionControl {
    /// Slot 4 (after IUnknown's three and `SetCodegenFlags`).
    const SET_IL_FUNCTION_BODY: usize = 4;

    /// The body (header first) the runtime compiles; it copies it.
    pub fn set_il_function_body(&self, body: &[u8]) -> HResult<()> {
        type F = unsafe extern "C" fn(*mut c_void, u32, *const u8) -> HRESULT;
        // SAFETY: SetILFunctionBody(ULONG, LPCBYTE) on the live control
        // object the runtime passed; the body outlives the call.
        unsafe {
            let vtbl = *(self.0.as_ptr() as *const *const *const c_void);
            let f = std::mem::transmute_copy::<*const c_void, F>(&*vtbl.add(Self::SET_IL_FUNCTION_BODY));
            crate::check(f(self.0.as_ptr(), body.len() as u32, body.as_ptr()))
        }
    }
}

#[repr(C)]
pub struct CallbackVtbl {
    pub query_interface: unsafe extern "C" fn(*mut c_void, *const Guid, *mut *mut c_void) -> HRESULT,
    pub add_ref: unsafe extern "C" fn(*mut c_void) -> u32,
    pub release: unsafe extern "C" fn(*mut c_void) -> u32,
    /// slot 3: `Initialize`
    pub initialize: unsafe extern "C" fn(*mut c_void, *mut c_void) -> HRESULT,
    /// slot 4: `Shutdown`
    pub shutdown: ThisOnly,
    /// slot 5: `AppDomainCreationStarted`
    pub app_domain_creation_started: Ignored,
    /// slot 6: `AppDomainCreationFinished`
    pub app_domain_creation_finished: Ignored,
    /// slot 7: `AppDomainShutdownStarted`
    pub app_domain_shutdown_started: Ignored,
    /// slot 8: `AppDomainShutdownFinished`
    pub app_domain_shutdown_finished: Ignored,
    /// slot 9: `AssemblyLoadStarted`
    pub assembly_load_started: Ignored,
    /// slot 10: `AssemblyLoadFinished`
    pub assembly_load_finished: Ignored,
    /// slot 11: `AssemblyUnloadStarted`
    pub assembly_unload_started: Ignored,
    /// slot 12: `AssemblyUnloadFinished`
    pub assembly_unload_finished: Ignored,
    /// slot 13: `ModuleLoadStarted`
    pub module_load_started: Ignored,
    /// slot 14: `ModuleLoadFinished`
    pub module_load_finished: unsafe extern "C" fn(*mut c_void, ModuleID, HRESULT) -> HRESULT,
    /// slot 15: `ModuleUnloadStarted`
    pub module_unload_started: unsafe extern "C" fn(*mut c_void, ModuleID) -> HRESULT,
    /// slot 16: `ModuleUnloadFinished`
    pub module_unload_finished: Ignored,
    /// slot 17: `ModuleAttachedToAssembly`
    pub module_attached_to_assembly: Ignored,
    /// slot 18: `ClassLoadStarted`
    pub class_load_started: Ignored,
    /// slot 19: `ClassLoadFinished`
    pub class_load_finished: unsafe extern "C" fn(*mut c_void, ClassID, HRESULT) -> HRESULT,
    /// slot 20: `ClassUnloadStarted`
    pub class_unload_started: Ignored,
    /// slot 21: `ClassUnloadFinished`
    pub class_unload_finished: Ignored,
    /// slot 22: `FunctionUnloadStarted`
    pub function_unload_started: Ignored,
    /// slot 23: `JITCompilationStarted`
    pub jit_compilation_started: Ignored,
    /// slot 24: `JITCompilationFinished`
    pub jit_compilation_finished: unsafe extern "C" fn(*mut c_void, FunctionID, HRESULT, i32) -> HRESULT,
    /// slot 25: `JITCachedFunctionSearchStarted`
    pub jit_cached_function_search_started: Ignored,
    /// slot 26: `JITCachedFunctionSearchFinished`
    pub jit_cached_function_search_finished: Ignored,
    /// slot 27: `JITFunctionPitched`
    pub jit_function_pitched: Ignored,
    /// slot 28: `JITInlining`
    pub jit_inlining: Ignored,
    /// slot 29: `ThreadCreated`
    pub thread_created: unsafe extern "C" fn(*mut c_void, ThreadID) -> HRESULT,
    /// slot 30: `ThreadDestroyed`
    pub thread_destroyed: unsafe extern "C" fn(*mut c_void, ThreadID) -> HRESULT,
    /// slot 31: `ThreadAssignedToOSThread`
    pub thread_assigned_to_os_thread: unsafe extern "C" fn(*mut c_void, ThreadID, u32) -> HRESULT,
    /// slot 32: `RemotingClientInvocationStarted`
    pub remoting_client_invocation_started: Ignored,
    /// slot 33: `RemotingClientSendingMessage`
    pub remoting_client_sending_message: Ignored,
    /// slot 34: `RemotingClientReceivingReply`
    pub remoting_client_receiving_reply: Ignored,
    /// slot 35: `RemotingClientInvocationFinished`
    pub remoting_client_invocation_finished: Ignored,
    /// slot 36: `RemotingServerReceivingMessage`
    pub remoting_server_receiving_message: Ignored,
    /// slot 37: `RemotingServerInvocationStarted`
    pub remoting_server_invocation_started: Ignored,
    /// slot 38: `RemotingServerInvocationReturned`
    pub remoting_server_invocation_returned: Ignored,
    /// slot 39: `RemotingServerSendingReply`
    pub remoting_server_sending_reply: Ignored,
    /// slot 40: `UnmanagedToManagedTransition`
    pub unmanaged_to_managed_transition: Ignored,
    /// slot 41: `ManagedToUnmanagedTransition`
    pub managed_to_unmanaged_transition: Ignored,
    /// slot 42: `RuntimeSuspendStarted`
    pub runtime_suspend_started: Ignored,
    /// slot 43: `RuntimeSuspendFinished`
    pub runtime_suspend_finished: Ignored,
    /// slot 44: `RuntimeSuspendAborted`
    pub runtime_suspend_aborted: Ignored,
    /// slot 45: `RuntimeResumeStarted`
    pub runtime_resume_started: Ignored,
    /// slot 46: `RuntimeResumeFinished`
    pub runtime_resume_finished: Ignored,
    /// slot 47: `RuntimeThreadSuspended`
    pub runtime_thread_suspended: Ignored,
    /// slot 48: `RuntimeThreadResumed`
    pub runtime_thread_resumed: Ignored,
    /// slot 49: `MovedReferences`
    pub moved_references: Ignored,
    /// slot 50: `ObjectAllocated`
    pub object_allocated: Ignored,
    /// slot 51: `ObjectsAllocatedByClass`
    pub objects_allocated_by_class: Ignored,
    /// slot 52: `ObjectReferences`
    pub object_references: Ignored,
    /// slot 53: `RootReferences`
    pub root_references: Ignored,
    /// slot 54: `ExceptionThrown`
    pub exception_thrown: unsafe extern "C" fn(*mut c_void, ObjectID) -> HRESULT,
    /// slot 55: `ExceptionSearchFunctionEnter`
    pub exception_search_function_enter: Ignored,
    /// slot 56: `ExceptionSearchFunctionLeave`
    pub exception_search_function_leave: Ignored,
    /// slot 57: `ExceptionSearchFilterEnter`
    pub exception_search_filter_enter: Ignored,
    /// slot 58: `ExceptionSearchFilterLeave`
    pub exception_search_filter_leave: Ignored,
    /// slot 59: `ExceptionSearchCatcherFound`
    pub exception_search_catcher_found: Ignored,
    /// slot 60: `ExceptionOSHandlerEnter`
    pub exception_os_handler_enter: Ignored,
    /// slot 61: `ExceptionOSHandlerLeave`
    pub exception_os_handler_leave: Ignored,
    /// slot 62: `ExceptionUnwindFunctionEnter`
    pub exception_unwind_function_enter: Ignored,
    /// slot 63: `ExceptionUnwindFunctionLeave`
    pub exception_unwind_function_leave: Ignored,
    /// slot 64: `ExceptionUnwindFinallyEnter`
    pub exception_unwind_finally_enter: Ignored,
    /// slot 65: `ExceptionUnwindFinallyLeave`
    pub exception_unwind_finally_leave: Ignored,
    /// slot 66: `ExceptionCatcherEnter`
    pub exception_catcher_enter: Ignored,
    /// slot 67: `ExceptionCatcherLeave`
    pub exception_catcher_leave: Ignored,
    /// slot 68: `COMClassicVTableCreated`
    pub com_classic_v_table_created: Ignored,
    /// slot 69: `COMClassicVTableDestroyed`
    pub com_classic_v_table_destroyed: Ignored,
    /// slot 70: `ExceptionCLRCatcherFound`
    pub exception_clr_catcher_found: Ignored,
    /// slot 71: `ExceptionCLRCatcherExecute`
    pub exception_clr_catcher_execute: Ignored,
    /// slot 72: `ThreadNameChanged`
    pub thread_name_changed: unsafe extern "C" fn(*mut c_void, ThreadID, u32, *const u16) -> HRESULT,
    /// slot 73: `GarbageCollectionStarted`
    pub garbage_collection_started: unsafe extern "C" fn(*mut c_void, i32, *const i32, u32) -> HRESULT,
    /// slot 74: `SurvivingReferences`
    pub surviving_references: Ignored,
    /// slot 75: `GarbageCollectionFinished`
    pub garbage_collection_finished: ThisOnly,
    /// slot 76: `FinalizeableObjectQueued`
    pub finalizeable_object_queued: Ignored,
    /// slot 77: `RootReferences2`
    pub root_references2: Ignored,
    /// slot 78: `HandleCreated`
    pub handle_created: Ignored,
    /// slot 79: `HandleDestroyed`
    pub handle_destroyed: Ignored,
    /// slot 80: `InitializeForAttach`
    pub initialize_for_attach: unsafe extern "C" fn(*mut c_void, *mut c_void, *const c_void, u32) -> HRESULT,
    /// slot 81: `ProfilerAttachComplete`
    pub profiler_attach_complete: ThisOnly,
    /// slot 82: `ProfilerDetachSucceeded`
    pub profiler_detach_succeeded: ThisOnly,
    /// slot 83: `ReJITCompilationStarted`
    pub re_jit_compilation_started: Ignored,
    /// slot 84: `GetReJITParameters`
    pub get_re_jit_parameters: unsafe extern "C" fn(*mut c_void, ModuleID, MdToken, *mut c_void) -> HRESULT,
    /// slot 85: `ReJITCompilationFinished`
    pub re_jit_compilation_finished: unsafe extern "C" fn(*mut c_void, FunctionID, usize, HRESULT, i32) -> HRESULT,
    /// slot 86: `ReJITError`
    pub re_jit_error: unsafe extern "C" fn(*mut c_void, ModuleID, MdToken, FunctionID, HRESULT) -> HRESULT,
    /// slot 87: `MovedReferences2`
    pub moved_references2: Ignored,
    /// slot 88: `SurvivingReferences2`
    pub surviving_references2: Ignored,
    /// slot 89: `ConditionalWeakTableElementReferences`
    pub conditional_weak_table_element_references: Ignored,
    /// slot 90: `GetAssemblyReferences`
    pub get_assembly_references: Ignored,
    /// slot 91: `ModuleInMemorySymbolsUpdated`
    pub module_in_memory_symbols_updated: Ignored,
    /// slot 92: `DynamicMethodJITCompilationStarted`
    pub dynamic_method_jit_compilation_started: Ignored,
    /// slot 93: `DynamicMethodJITCompilationFinished`
    pub dynamic_method_jit_compilation_finished: Ignored,
    /// slot 94: `DynamicMethodUnloaded`
    pub dynamic_method_unloaded: Ignored,
    /// slot 95: `EventPipeEventDelivered`
    pub event_pipe_event_delivered: unsafe extern "C" fn(
        *mut c_void,
        usize,
        u32,
        u32,
        u32,
        *const u8,
        u32,
        *const u8,
        *const Guid,
        *const Guid,
        ThreadID,
        u32,
        *const usize,
    ) -> HRESULT,
    /// slot 96: `EventPipeProviderCreated`
    pub event_pipe_provider_created: Ignored,
    /// slot 97: `LoadAsNotificationOnly`
    pub load_as_notification_only: unsafe extern "C" fn(*mut c_void, *mut i32) -> HRESULT,
}

const _: () = {
    assert!(std::mem::size_of::<CallbackVtbl>() == CALLBACK_VTABLE_SLOTS * 8);
    assert!(offset_of!(CallbackVtbl, initialize) == 3 * 8);
    assert!(offset_of!(CallbackVtbl, shutdown) == 4 * 8);
    assert!(offset_of!(CallbackVtbl, module_load_finished) == 14 * 8);
    assert!(offset_of!(CallbackVtbl, module_unload_started) == 15 * 8);
    assert!(offset_of!(CallbackVtbl, class_load_finished) == 19 * 8);
    assert!(offset_of!(CallbackVtbl, jit_compilation_finished) == 24 * 8);
    assert!(offset_of!(CallbackVtbl, thread_created) == 29 * 8);
    assert!(offset_of!(CallbackVtbl, thread_destroyed) == 30 * 8);
    assert!(offset_of!(CallbackVtbl, thread_assigned_to_os_thread) == 31 * 8);
    assert!(offset_of!(CallbackVtbl, exception_thrown) == 54 * 8);
    assert!(offset_of!(CallbackVtbl, thread_name_changed) == 72 * 8);
    assert!(offset_of!(CallbackVtbl, garbage_collection_started) == 73 * 8);
    assert!(offset_of!(CallbackVtbl, garbage_collection_finished) == 75 * 8);
    assert!(offset_of!(CallbackVtbl, initialize_for_attach) == 80 * 8);
    assert!(offset_of!(CallbackVtbl, profiler_attach_complete) == 81 * 8);
    assert!(offset_of!(CallbackVtbl, profiler_detach_succeeded) == 82 * 8);
    assert!(offset_of!(CallbackVtbl, load_as_notification_only) == 97 * 8);
    assert!(offset_of!(CallbackVtbl, get_re_jit_parameters) == 84 * 8);
    assert!(offset_of!(CallbackVtbl, re_jit_error) == 86 * 8);
    assert!(offset_of!(CallbackVtbl, re_jit_compilation_finished) == 85 * 8);
    assert!(offset_of!(CallbackVtbl, event_pipe_event_delivered) == 95 * 8);
};

/// The COM object: a vtable pointer first, as the runtime expects, then our
/// reference count and the implementation.
#[repr(C)]
struct CallbackObject<T: ProfilerCallbacks> {
    vtbl: &'static CallbackVtbl,
    refs: AtomicU32,
    inner: T,
}

struct VtableFor<T>(std::marker::PhantomData<T>);

impl<T: ProfilerCallbacks> VtableFor<T> {
    const VTBL: CallbackVtbl = CallbackVtbl {
        query_interface: tramp::query_interface::<T>,
        add_ref: tramp::add_ref::<T>,
        release: tramp::release::<T>,
        initialize: tramp::initialize::<T>,
        shutdown: tramp::shutdown::<T>,
        app_domain_creation_started: tramp::ignored,
        app_domain_creation_finished: tramp::ignored,
        app_domain_shutdown_started: tramp::ignored,
        app_domain_shutdown_finished: tramp::ignored,
        assembly_load_started: tramp::ignored,
        assembly_load_finished: tramp::ignored,
        assembly_unload_started: tramp::ignored,
        assembly_unload_finished: tramp::ignored,
        module_load_started: tramp::ignored,
        module_load_finished: tramp::module_load_finished::<T>,
        module_unload_started: tramp::module_unload_started::<T>,
        module_unload_finished: tramp::ignored,
        module_attached_to_assembly: tramp::ignored,
        class_load_started: tramp::ignored,
        class_load_finished: tramp::class_load_finished::<T>,
        class_unload_started: tramp::ignored,
        class_unload_finished: tramp::ignored,
        function_unload_started: tramp::ignored,
        jit_compilation_started: tramp::ignored,
        jit_compilation_finished: tramp::jit_compilation_finished::<T>,
        jit_cached_function_search_started: tramp::ignored,
        jit_cached_function_search_finished: tramp::ignored,
        jit_function_pitched: tramp::ignored,
        jit_inlining: tramp::ignored,
        thread_created: tramp::thread_created::<T>,
        thread_destroyed: tramp::thread_destroyed::<T>,
        thread_assigned_to_os_thread: tramp::thread_assigned_to_os_thread::<T>,
        remoting_client_invocation_started: tramp::ignored,
        remoting_client_sending_message: tramp::ignored,
        remoting_client_receiving_reply: tramp::ignored,
        remoting_client_invocation_finished: tramp::ignored,
        remoting_server_receiving_message: tramp::ignored,
        remoting_server_invocation_started: tramp::ignored,
        remoting_server_invocation_returned: tramp::ignored,
        remoting_server_sending_reply: tramp::ignored,
        unmanaged_to_managed_transition: tramp::ignored,
        managed_to_unmanaged_transition: tramp::ignored,
        runtime_suspend_started: tramp::ignored,
        runtime_suspend_finished: tramp::ignored,
        runtime_suspend_aborted: tramp::ignored,
        runtime_resume_started: tramp::ignored,
        runtime_resume_finished: tramp::ignored,
        runtime_thread_suspended: tramp::ignored,
        runtime_thread_resumed: tramp::ignored,
        moved_references: tramp::ignored,
        object_allocated: tramp::ignored,
        objects_allocated_by_class: tramp::ignored,
        object_references: tramp::ignored,
        root_references: tramp::ignored,
        exception_thrown: tramp::exception_thrown::<T>,
        exception_search_function_enter: tramp::ignored,
        exception_search_function_leave: tramp::ignored,
        exception_search_filter_enter: tramp::ignored,
        exception_search_filter_leave: tramp::ignored,
        exception_search_catcher_found: tramp::ignored,
        exception_os_handler_enter: tramp::ignored,
        exception_os_handler_leave: tramp::ignored,
        exception_unwind_function_enter: tramp::ignored,
        exception_unwind_function_leave: tramp::ignored,
        exception_unwind_finally_enter: tramp::ignored,
        exception_unwind_finally_leave: tramp::ignored,
        exception_catcher_enter: tramp::ignored,
        exception_catcher_leave: tramp::ignored,
        com_classic_v_table_created: tramp::ignored,
        com_classic_v_table_destroyed: tramp::ignored,
        exception_clr_catcher_found: tramp::ignored,
        exception_clr_catcher_execute: tramp::ignored,
        thread_name_changed: tramp::thread_name_changed::<T>,
        garbage_collection_started: tramp::garbage_collection_started::<T>,
        surviving_references: tramp::ignored,
        garbage_collection_finished: tramp::garbage_collection_finished::<T>,
        finalizeable_object_queued: tramp::ignored,
        root_references2: tramp::ignored,
        handle_created: tramp::ignored,
        handle_destroyed: tramp::ignored,
        initialize_for_attach: tramp::initialize_for_attach::<T>,
        profiler_attach_complete: tramp::profiler_attach_complete::<T>,
        profiler_detach_succeeded: tramp::profiler_detach_succeeded::<T>,
        re_jit_compilation_started: tramp::ignored,
        get_re_jit_parameters: tramp::get_re_jit_parameters::<T>,
        re_jit_compilation_finished: tramp::re_jit_compilation_finished::<T>,
        re_jit_error: tramp::re_jit_error::<T>,
        moved_references2: tramp::ignored,
        surviving_references2: tramp::ignored,
        conditional_weak_table_element_references: tramp::ignored,
        get_assembly_references: tramp::ignored,
        module_in_memory_symbols_updated: tramp::ignored,
        dynamic_method_jit_compilation_started: tramp::ignored,
        dynamic_method_jit_compilation_finished: tramp::ignored,
        dynamic_method_unloaded: tramp::ignored,
        event_pipe_event_delivered: tramp::event_pipe_event_delivered::<T>,
        event_pipe_provider_created: tramp::ignored,
        load_as_notification_only: tramp::load_as_notification_only,
    };
}

/// Runs one entry from the runtime; a panic becomes `E_FAIL` instead of
/// unwinding through C frames (which would abort, or worse).
pub fn guard(f: impl FnOnce() -> HRESULT) -> HRESULT {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(hr::E_FAIL)
}

mod tramp {
    use super::*;

    /// # Safety
    /// `this` must be a live `CallbackObject<T>` handed out by our factory.
    unsafe fn object<'a, T: ProfilerCallbacks>(this: *mut c_void) -> &'a CallbackObject<T> {
        // SAFETY: the runtime only calls us through pointers we gave it, and
        // holds a reference for as long as it calls.
        unsafe { &*(this as *const CallbackObject<T>) }
    }

    fn unit(f: impl FnOnce()) -> HRESULT {
        guard(|| {
            f();
            hr::S_OK
        })
    }

    pub unsafe extern "C" fn query_interface<T: ProfilerCallbacks>(
        this: *mut c_void,
        riid: *const Guid,
        out: *mut *mut c_void,
    ) -> HRESULT {
        if out.is_null() || riid.is_null() {
            return hr::E_POINTER;
        }
        // SAFETY: checked non-null; the runtime passes a valid IID.
        let riid = unsafe { *riid };
        let known = riid == iid::IUNKNOWN || iid::ICORPROFILERCALLBACK.contains(&riid);
        if !known {
            // SAFETY: `out` checked non-null.
            unsafe { *out = std::ptr::null_mut() };
            return hr::E_NOINTERFACE;
        }
        // SAFETY: `this` is our object; `out` checked non-null.
        unsafe {
            add_ref::<T>(this);
            *out = this;
        }
        hr::S_OK
    }

    pub unsafe extern "C" fn add_ref<T: ProfilerCallbacks>(this: *mut c_void) -> u32 {
        // SAFETY: see `object`.
        unsafe { object::<T>(this) }.refs.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub unsafe extern "C" fn release<T: ProfilerCallbacks>(this: *mut c_void) -> u32 {
        // SAFETY: see `object`.
        let left = unsafe { object::<T>(this) }.refs.fetch_sub(1, Ordering::AcqRel) - 1;
        if left == 0 {
            // SAFETY: the last reference is gone; the object came from Box::into_raw.
            drop(unsafe { Box::from_raw(this as *mut CallbackObject<T>) });
        }
        left
    }

    pub unsafe extern "C" fn ignored(_this: *mut c_void) -> HRESULT {
        hr::S_OK
    }

    pub unsafe extern "C" fn initialize<T: ProfilerCallbacks>(this: *mut c_void, info_unknown: *mut c_void) -> HRESULT {
        guard(|| {
            // SAFETY: the runtime passes its IUnknown for ICorProfilerInfo*.
            match unsafe { CorProfilerInfo::from_unknown(info_unknown) } {
                // SAFETY: see `object`.
                Ok(info) => unsafe { object::<T>(this) }.inner.initialize(info),
                Err(e) => e.0,
            }
        })
    }

    pub unsafe extern "C" fn initialize_for_attach<T: ProfilerCallbacks>(
        this: *mut c_void,
        info_unknown: *mut c_void,
        client_data: *const c_void,
        client_len: u32,
    ) -> HRESULT {
        guard(|| {
            let data: &[u8] = if client_data.is_null() || client_len == 0 {
                &[]
            } else {
                // SAFETY: the runtime owns these bytes for the call's duration.
                unsafe { std::slice::from_raw_parts(client_data as *const u8, client_len as usize) }
            };
            // SAFETY: the runtime passes its IUnknown for ICorProfilerInfo*.
            match unsafe { CorProfilerInfo::from_unknown(info_unknown) } {
                // SAFETY: see `object`.
                Ok(info) => unsafe { object::<T>(this) }.inner.initialize_for_attach(info, data),
                Err(e) => e.0,
            }
        })
    }

    pub unsafe extern "C" fn load_as_notification_only(_this: *mut c_void, notification_only: *mut i32) -> HRESULT {
        if notification_only.is_null() {
            return hr::E_POINTER;
        }
        // corsnap is a main profiler: it needs SuspendRuntime and stack snapshots.
        // SAFETY: checked non-null.
        unsafe { *notification_only = 0 };
        hr::S_OK
    }

    macro_rules! simple {
        ($name:ident ( $($arg:ident : $ty:ty),* ) => |$inner:ident| $body:expr) => {
            pub unsafe extern "C" fn $name<T: ProfilerCallbacks>(this: *mut c_void $(, $arg: $ty)*) -> HRESULT {
                unit(|| {
                    // SAFETY: see `object`.
                    let $inner = &unsafe { object::<T>(this) }.inner;
                    $body
                })
            }
        };
    }

    simple!(shutdown() => |p| p.shutdown());
    simple!(profiler_attach_complete() => |p| p.profiler_attach_complete());
    simple!(profiler_detach_succeeded() => |p| p.profiler_detach_succeeded());
    simple!(garbage_collection_finished() => |p| p.garbage_collection_finished());
    simple!(module_load_finished(m: ModuleID, s: HRESULT) => |p| p.module_load_finished(m, s));
    simple!(module_unload_started(m: ModuleID) => |p| p.module_unload_started(m));
    simple!(class_load_finished(c: ClassID, s: HRESULT) => |p| p.class_load_finished(c, s));
    simple!(jit_compilation_finished(f: FunctionID, s: HRESULT, b: i32) => |p| p.jit_compilation_finished(f, s, b != 0));
    simple!(thread_created(t: ThreadID) => |p| p.thread_created(t));
    simple!(thread_destroyed(t: ThreadID) => |p| p.thread_destroyed(t));
    simple!(thread_assigned_to_os_thread(t: ThreadID, os: u32) => |p| p.thread_assigned_to_os_thread(t, os));
    simple!(exception_thrown(o: ObjectID) => |p| p.exception_thrown(o));
    simple!(re_jit_compilation_finished(f: FunctionID, r: usize, s: HRESULT, _b: i32) => |p| p.rejit_compilation_finished(f, r, s));
    simple!(re_jit_error(m: ModuleID, t: MdToken, _f: FunctionID, s: HRESULT) => |p| p.rejit_error(m, t, s));

    pub unsafe extern "C" fn get_re_jit_parameters<T: ProfilerCallbacks>(
        this: *mut c_void,
        module: ModuleID,
        method: MdToken,
        control: *mut c_void,
    ) -> HRESULT {
        unit(|| {
            if let Some(control) = NonNull::new(control) {
                // SAFETY: see `object`; the runtime's control object is valid
                // for the call.
                unsafe { object::<T>(this) }.inner.get_rejit_parameters(module, method, FunctionControl(control))
            }
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub unsafe extern "C" fn event_pipe_event_delivered<T: ProfilerCallbacks>(
        this: *mut c_void,
        _provider: usize,
        event_id: u32,
        version: u32,
        _metadata_len: u32,
        _metadata: *const u8,
        payload_len: u32,
        payload: *const u8,
        _activity: *const Guid,
        _related_activity: *const Guid,
        thread: ThreadID,
        frame_count: u32,
        frames: *const usize,
    ) -> HRESULT {
        unit(|| {
            let payload: &[u8] = if payload.is_null() {
                &[]
            } else {
                // SAFETY: the runtime passes `payload_len` bytes, valid for the call.
                unsafe { std::slice::from_raw_parts(payload, payload_len as usize) }
            };
            let stack: &[usize] = if frames.is_null() {
                &[]
            } else {
                // SAFETY: the runtime passes `frame_count` IPs, valid for the call.
                unsafe { std::slice::from_raw_parts(frames, frame_count as usize) }
            };
            // SAFETY: see `object`.
            unsafe { object::<T>(this) }.inner.event_pipe_event_delivered(event_id, version, payload, thread, stack)
        })
    }

    pub unsafe extern "C" fn thread_name_changed<T: ProfilerCallbacks>(
        this: *mut c_void,
        thread: ThreadID,
        len: u32,
        name: *const u16,
    ) -> HRESULT {
        unit(|| {
            let name: &[u16] = if name.is_null() {
                &[]
            } else {
                // SAFETY: the runtime passes `len` UTF-16 units, valid for the call.
                unsafe { std::slice::from_raw_parts(name, len as usize) }
            };
            // The count may include a terminating NUL on some runtimes.
            let name = name.split(|&c| c == 0).next().unwrap_or(&[]);
            // SAFETY: see `object`.
            unsafe { object::<T>(this) }.inner.thread_name_changed(thread, name)
        })
    }

    pub unsafe extern "C" fn garbage_collection_started<T: ProfilerCallbacks>(
        this: *mut c_void,
        count: i32,
        collected: *const i32,
        reason: u32,
    ) -> HRESULT {
        unit(|| {
            let mut generations = [false; 8];
            let n = (count.max(0) as usize).min(generations.len());
            if !collected.is_null() {
                for (i, g) in generations.iter_mut().enumerate().take(n) {
                    // SAFETY: the runtime passes `count` BOOLs, valid for the call.
                    *g = unsafe { *collected.add(i) } != 0;
                }
            }
            // SAFETY: see `object`.
            unsafe { object::<T>(this) }.inner.garbage_collection_started(&generations[..n], reason)
        })
    }
}

// ---------------------------------------------------------------------------
// The class factory.

#[repr(C)]
struct ClassFactoryVtbl {
    query_interface: unsafe extern "C" fn(*mut c_void, *const Guid, *mut *mut c_void) -> HRESULT,
    add_ref: unsafe extern "C" fn(*mut c_void) -> u32,
    release: unsafe extern "C" fn(*mut c_void) -> u32,
    create_instance: unsafe extern "C" fn(*mut c_void, *mut c_void, *const Guid, *mut *mut c_void) -> HRESULT,
    lock_server: unsafe extern "C" fn(*mut c_void, i32) -> HRESULT,
}

/// A stateless factory: a static object whose only field is its vtable.
#[repr(C)]
struct ClassFactory {
    vtbl: &'static ClassFactoryVtbl,
}

struct FactoryFor<T>(std::marker::PhantomData<T>);

impl<T: ProfilerCallbacks> FactoryFor<T> {
    const VTBL: ClassFactoryVtbl = ClassFactoryVtbl {
        query_interface: factory_query_interface,
        add_ref: factory_refcount,
        release: factory_refcount,
        create_instance: factory_create_instance::<T>,
        lock_server: factory_lock_server,
    };
    const FACTORY: ClassFactory = ClassFactory { vtbl: &Self::VTBL };
}

unsafe extern "C" fn factory_query_interface(this: *mut c_void, riid: *const Guid, out: *mut *mut c_void) -> HRESULT {
    if out.is_null() || riid.is_null() {
        return hr::E_POINTER;
    }
    // SAFETY: checked non-null.
    let riid = unsafe { *riid };
    // SAFETY: checked non-null.
    unsafe {
        if riid == iid::IUNKNOWN || riid == iid::ICLASSFACTORY {
            *out = this;
            hr::S_OK
        } else {
            *out = std::ptr::null_mut();
            hr::E_NOINTERFACE
        }
    }
}

/// The factory is static, so counting references would only be for show.
unsafe extern "C" fn factory_refcount(_this: *mut c_void) -> u32 {
    1
}

unsafe extern "C" fn factory_lock_server(_this: *mut c_void, _lock: i32) -> HRESULT {
    hr::S_OK
}

unsafe extern "C" fn factory_create_instance<T: ProfilerCallbacks>(
    _this: *mut c_void,
    outer: *mut c_void,
    riid: *const Guid,
    out: *mut *mut c_void,
) -> HRESULT {
    if out.is_null() {
        return hr::E_POINTER;
    }
    if !outer.is_null() {
        return hr::CLASS_E_NOAGGREGATION;
    }
    guard(|| {
        let object =
            Box::new(CallbackObject { vtbl: &VtableFor::<T>::VTBL, refs: AtomicU32::new(1), inner: T::create() });
        let raw = Box::into_raw(object) as *mut c_void;
        // SAFETY: `raw` is a fresh object with one reference, which the
        // query below either hands out (plus one) or we drop again.
        unsafe {
            let hr = tramp::query_interface::<T>(raw, riid, out);
            tramp::release::<T>(raw);
            hr
        }
    })
}

/// The body of `DllGetClassObject` for profiler type `T` and its CLSID.
///
/// # Safety
/// The pointers must be what the runtime passes to `DllGetClassObject`.
pub unsafe fn class_factory_for<T: ProfilerCallbacks>(
    clsid: Guid,
    rclsid: *const Guid,
    riid: *const Guid,
    out: *mut *mut c_void,
) -> HRESULT {
    if rclsid.is_null() || riid.is_null() || out.is_null() {
        return hr::E_POINTER;
    }
    // SAFETY: checked non-null; valid per the caller's contract.
    unsafe {
        *out = std::ptr::null_mut();
        if *rclsid != clsid {
            return hr::CLASS_E_CLASSNOTAVAILABLE;
        }
        let factory: &'static ClassFactory = &FactoryFor::<T>::FACTORY;
        factory_query_interface(factory as *const ClassFactory as *mut c_void, riid, out)
    }
}

/// Exports `DllGetClassObject`, the one symbol CoreCLR looks up in a profiler.
#[macro_export]
macro_rules! export_profiler {
    ($ty:ty, $clsid:expr) => {
        /// Called by CoreCLR to obtain our class factory.
        ///
        /// # Safety
        /// Called by the runtime with valid pointers.
        #[no_mangle]
        #[allow(unsafe_code)]
        pub unsafe extern "C" fn DllGetClassObject(
            rclsid: *const $crate::Guid,
            riid: *const $crate::Guid,
            out: *mut *mut ::std::ffi::c_void,
        ) -> $crate::HRESULT {
            // SAFETY: forwarded unchanged from the runtime.
            unsafe { $crate::class_factory_for::<$ty>($clsid, rclsid, riid, out) }
        }
    };
}
