// A startup hook (DOTNET_STARTUP_HOOKS) that subscribes a handler to
// AppDomain.FirstChanceException, for bench/events.py's floor rows of the
// third way the runtime tells code in the process of a throw (after the
// profiler's exception callbacks and EventPipe's ExceptionThrown_V1): with
// a subscriber, the runtime's exception dispatch calls into managed code
// once per throw (AppContext.OnFirstChanceException) and allocates its
// event arguments.
//
// The handler does nothing (the `firstchance` row), or, under a corsnap
// recording with CORSNAP_BENCH_EXCEPTIONS=firstchance-walk, calls the
// agent's `corsnap_first_chance` (found in the library the runtime loaded
// as its profiler, CORECLR_PROFILER_PATH), which walks the throwing
// thread's stack and drops it (the `firstchance-walk` row).
//
// Built as an exe only because scripts/build-cs.sh builds those; the runtime
// loads a hook from any assembly.
using System;
using System.Runtime.ExceptionServices;
using System.Runtime.InteropServices;

internal static unsafe class StartupHook
{
    static delegate* unmanaged<void> s_agent;

    public static void Initialize()
    {
        var path = Environment.GetEnvironmentVariable("CORECLR_PROFILER_PATH");
        if (Environment.GetEnvironmentVariable("CORSNAP_BENCH_EXCEPTIONS") == "firstchance-walk" && path != null)
        {
            s_agent = (delegate* unmanaged<void>)NativeLibrary.GetExport(NativeLibrary.Load(path), "corsnap_first_chance");
            AppDomain.CurrentDomain.FirstChanceException += CallAgent;
        }
        else
        {
            AppDomain.CurrentDomain.FirstChanceException += (_, _) => { };
        }
    }

    static void CallAgent(object sender, FirstChanceExceptionEventArgs e) => s_agent();
}

internal static class FirstChanceHook
{
    static void Main() => Console.WriteLine("firstchance_hook.dll is a startup hook: set DOTNET_STARTUP_HOOKS to its path");
}
