//! Exceptions from a call as the runtime's managed exception dispatch
//! starts (.NET 9 and later): the three entry points that call
//! `System.Runtime.EH.DispatchEx` (`RhThrowEx`, `RhRethrow`,
//! `RhThrowHwEx`) compiled again (ReJIT) with a call of the agent just
//! before that call, on the throwing thread (`corsnap_abi::throw_hook`). No
//! exception callbacks, no EventPipe session: their cost on .NET 10 was the
//! floor issue 18's target sat below.
//!
//! Why the entry points and not `DispatchEx` itself (as before): a body
//! asked for by ReJIT starts at the method's first tier, and `DispatchEx`
//! (313 bytes of IL on .NET 10) was compiled twice at instrumented Tier0
//! and again at Tier1, and the small methods its precompiled code inlines
//! were each called and compiled at two tiers while it ran at Tier0: 16
//! more bodies for the runtime's tiering thread, which took that CPU from
//! the program's threads. The entry points are 28 to 187 bytes, and leave
//! `DispatchEx` precompiled. Should one of them not have the call where it
//! is looked for (`corsnap_abi::il::call_after_ldarg`), `DispatchEx` is
//! rewritten instead, with the call before its code.
//!
//! The agent asks for the ReJIT from the sampler thread (it suspends the
//! runtime, never from a callback), as soon as CoreLib is loaded. Until
//! then throws come from EventPipe when recording; that session ends once
//! the ReJIT is asked for (see `tend_throw_hook`), and starts again should
//! the rewritten dispatch fail to compile. A throw seen by both is counted
//! once (the call marks its thread, the event that follows on that thread
//! is skipped). Before a detach (which the runtime then refuses: ReJIT was
//! enabled) the handler is cleared and the
//! method reverted.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Mutex;

use corsnap_abi::{throw_hook, CorProfilerInfo, FunctionControl, HResult, MdToken, ModuleID};

/// How far the hook has come.
pub(crate) mod state {
    /// Not wanted, or not asked for yet.
    pub const IDLE: u8 = 0;
    /// The ReJIT was asked for (the rewritten dispatch is compiled at its
    /// first call, `ThrowHook::called`), and the EventPipe session ended.
    pub const REQUESTED: u8 = 1;
    /// It could not be put in place (logged); EventPipe stays, or starts
    /// again.
    pub const FAILED: u8 = 2;
    /// It failed, and throws come from EventPipe again.
    pub const FELL_BACK: u8 = 4;
    /// Taken out (detach).
    pub const REMOVED: u8 = 3;
}

/// A rewritten method: where it is, and the body given in
/// `GetReJITParameters`.
struct Rewritten {
    module: ModuleID,
    method: MdToken,
    body: Vec<u8>,
}

/// The methods rewritten (the three entry points, or `DispatchEx`).
static REWRITTEN: Mutex<Vec<Rewritten>> = Mutex::new(Vec::new());

/// The methods that call `DispatchEx`, each once, with their `ref ExInfo`
/// as argument 1 (CoreLib 9.0 and 10.0, checked by a scan of every method
/// body of both).
const ENTRY_POINTS: [&str; 3] = ["RhThrowEx", "RhRethrow", "RhThrowHwEx"];

/// The hook of one recording.
#[derive(Debug, Default)]
pub(crate) struct ThrowHook {
    pub state: AtomicU8,
    /// A call came: the rewritten dispatch runs.
    pub called: AtomicBool,
}

thread_local! {
    /// A dispatch on this thread was counted by the hook, and EventPipe's
    /// event for it (if a session still runs) is to be skipped.
    static COUNTED_BY_HOOK: Cell<bool> = const { Cell::new(false) };
}

/// Marks the calling thread's dispatch as counted by the hook.
pub(crate) fn mark_counted() {
    let _ = COUNTED_BY_HOOK.try_with(|c| c.set(true));
}

/// Whether EventPipe's event on this thread was already counted by the
/// hook (and forgets it).
pub(crate) fn take_counted() -> bool {
    COUNTED_BY_HOOK.try_with(|c| c.replace(false)).unwrap_or(false)
}

/// CoreLib's module: `Ok(None)` while no module is loaded yet (CoreLib is
/// the first), an error once others are and it is not among them.
fn core_library(info: &CorProfilerInfo) -> Result<Option<ModuleID>, String> {
    let modules = info.enum_modules().map_err(|e| format!("EnumModules: {e}"))?;
    let core = modules.iter().copied().find(|&m| {
        info.get_module_info(m).is_ok_and(|(_, path)| {
            path.rsplit(['/', '\\']).next().is_some_and(|f| f.eq_ignore_ascii_case("System.Private.CoreLib.dll"))
        })
    });
    match core {
        Some(m) => Ok(Some(m)),
        None if modules.len() > 1 => Err(format!("no System.Private.CoreLib.dll among {} modules", modules.len())),
        None => Ok(None),
    }
}

/// Builds the rewritten methods and asks for their ReJIT; their names, for
/// the log. `Ok(None)`: CoreLib is not loaded yet (ask again later).
pub(crate) fn request(info: &CorProfilerInfo, handler: throw_hook::Handler) -> Result<Option<String>, String> {
    let Some(core) = core_library(info)? else { return Ok(None) };
    let step = |what: &str, r: HResult<MdToken>| r.map_err(|e| format!("{what}: {e}"));
    let import = info.get_module_metadata(core).map_err(|e| format!("CoreLib's metadata: {e}"))?;
    let eh = step("System.Runtime.EH", import.find_type_def_by_name("System.Runtime.EH", 0))?;
    let ex_info = step("EH+ExInfo", import.find_type_def_by_name("ExInfo", eh))?;
    let exception = step("ExInfo.ThrownException", import.find_method(ex_info, "get_ThrownException"))?;
    let dispatch = step("EH.DispatchEx", import.find_method(eh, "DispatchEx"))?;
    let helpers =
        step("RuntimeHelpers", import.find_type_def_by_name("System.Runtime.CompilerServices.RuntimeHelpers", 0))?;
    let get_method_table = step("RuntimeHelpers.GetMethodTable", import.find_method(helpers, "GetMethodTable"))?;
    let reusable: Vec<&[u8]> = throw_hook::REUSABLE_SIGNATURES.iter().map(|&(blob, _)| blob).collect();
    let (signature, returns_int32) = match import.find_signature(&reusable) {
        Ok(Some((i, token))) => (token, throw_hook::REUSABLE_SIGNATURES[i].1),
        // None there: made, in CoreLib's metadata opened for writing.
        _ => {
            let emit =
                info.get_module_metadata_for_emit(core).map_err(|e| format!("CoreLib's metadata for writing: {e}"))?;
            (step("the call's signature", emit.get_token_from_sig(&throw_hook::CALLI_SIGNATURE))?, false)
        }
    };
    let call = throw_hook::hook_call(exception, get_method_table, signature, returns_int32);
    // `CORSNAP_TEST_HOOK_AT_DISPATCH=1` (tests): the way taken when an entry
    // point is not as expected, which no runtime served here takes.
    let at_entry_points = if std::env::var("CORSNAP_TEST_HOOK_AT_DISPATCH").is_ok_and(|v| v == "1") {
        Err("CORSNAP_TEST_HOOK_AT_DISPATCH=1".to_string())
    } else {
        entry_points_rewritten(info, &import, core, eh, dispatch, &call)
    };
    let (rewritten, names) = match at_entry_points {
        Ok(rewritten) => (rewritten, ENTRY_POINTS.join(", ")),
        Err(e) => {
            crate::log::write(format_args!("exceptions: {e}; DispatchEx is rewritten instead"));
            let original = info.get_il_function_body(core, dispatch).map_err(|e| format!("DispatchEx's IL: {e}"))?;
            let body = corsnap_abi::il::prepend(&original, &call, throw_hook::HOOK_CALL_STACK)
                .map_err(|e| format!("DispatchEx's IL: {e}"))?;
            (vec![Rewritten { module: core, method: dispatch, body }], "DispatchEx".to_string())
        }
    };
    let methods: Vec<(ModuleID, MdToken)> = rewritten.iter().map(|r| (r.module, r.method)).collect();
    *REWRITTEN.lock().unwrap_or_else(|p| p.into_inner()) = rewritten;
    throw_hook::set_handler(Some(handler));
    info.request_rejit(&methods).map_err(|e| format!("RequestReJIT: {e}"))?;
    Ok(Some(names))
}

/// The three entry points, each with `call` put just before its call of
/// `dispatch`, or why not.
fn entry_points_rewritten(
    info: &CorProfilerInfo,
    import: &corsnap_abi::MetaDataImport,
    core: ModuleID,
    eh: MdToken,
    dispatch: MdToken,
    call: &[u8],
) -> Result<Vec<Rewritten>, String> {
    ENTRY_POINTS
        .iter()
        .map(|&name| {
            let method = import.find_method(eh, name).map_err(|e| format!("EH.{name}: {e}"))?;
            let original = info.get_il_function_body(core, method).map_err(|e| format!("{name}'s IL: {e}"))?;
            let at = corsnap_abi::il::call_after_ldarg(&original, dispatch, 1)
                .map_err(|e| format!("{name}'s IL: {e}"))?
                .ok_or_else(|| format!("{name} has no call of DispatchEx with its argument 1"))?;
            let body = corsnap_abi::il::insert_before(&original, at, call, throw_hook::HOOK_CALL_STACK)
                .map_err(|e| format!("{name}'s IL: {e}"))?;
            Ok(Rewritten { module: core, method, body })
        })
        .collect()
}

/// `GetReJITParameters`: the rewritten body, for the method asked for.
pub(crate) fn rejit_parameters(module: ModuleID, method: MdToken, control: FunctionControl) -> Result<(), String> {
    let rewritten = REWRITTEN.lock().unwrap_or_else(|p| p.into_inner());
    match rewritten.iter().find(|r| r.module == module && r.method == method) {
        Some(r) => control.set_il_function_body(&r.body).map_err(|e| format!("SetILFunctionBody: {e}")),
        None => Ok(()),
    }
}

/// Takes the hook out before a detach: no handler, the original methods
/// back. (The library stays loaded: see `throw_hook::set_handler`.)
pub(crate) fn remove(info: &CorProfilerInfo, hook: &ThrowHook) {
    let was = hook.state.swap(state::REMOVED, Ordering::SeqCst);
    if was == state::IDLE || was == state::REMOVED {
        return;
    }
    throw_hook::set_handler(None);
    let rewritten = std::mem::take(&mut *REWRITTEN.lock().unwrap_or_else(|p| p.into_inner()));
    let methods: Vec<(ModuleID, MdToken)> = rewritten.iter().map(|r| (r.module, r.method)).collect();
    if !methods.is_empty() {
        if let Err(e) = info.request_revert(&methods) {
            crate::log::write(format_args!("RequestRevert of the dispatch hook's methods: {e}"));
        }
    }
}
