// A startup hook (DOTNET_STARTUP_HOOKS) that subscribes an empty handler to
// AppDomain.FirstChanceException: the floor of the third way the runtime
// reports a throw to code in the process (after the profiler's exception
// callbacks and EventPipe's ExceptionThrown_V1), measured by
// bench/events.py's `firstchance` row. With a subscriber, the runtime's
// exception dispatch calls into managed code once per throw
// (AppContext.OnFirstChanceException) and allocates its event arguments.
// Built as an exe only because scripts/build-cs.sh builds those; the runtime
// loads a hook from any assembly.
using System;

internal static class StartupHook
{
    public static void Initialize()
    {
        AppDomain.CurrentDomain.FirstChanceException += (_, _) => { };
    }
}

internal static class FirstChanceHook
{
    static void Main() => Console.WriteLine("firstchance_hook.dll is a startup hook: set DOTNET_STARTUP_HOOKS to its path");
}
