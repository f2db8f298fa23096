// Test program: the child spawner.cs starts. Says whether corsnap's agent
// is in its memory, burns CPU in Spawned.Burn, and reports its CPU time.
//
//   dotnet spawned.dll [seconds=2]
//
// Prints "spawned <pid> agent-mapped yes|no" (read from /proc/self/maps once
// Main runs, after the runtime has loaded, or released, any profiler), spins
// for `seconds`, then prints "spawned cpu-ms <its own CPU time>".
using System;
using System.Diagnostics;
using System.Globalization;
using System.IO;
using System.Runtime.CompilerServices;

public static class Spawned
{
    public static volatile int s_sink;
    static ulong s_acc = 0x2545F4914F6CDD1DUL;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Burn(double seconds)
    {
        var sw = Stopwatch.StartNew();
        ulong x = s_acc | 1;
        while (sw.Elapsed.TotalSeconds < seconds)
        {
            for (int i = 0; i < 4096; i++)
            {
                x = x * 6364136223846793005UL + 1442695040888963407UL;
            }
        }
        s_acc ^= x;
        s_sink = (int)x;
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 2;
        bool mapped = File.ReadAllText("/proc/self/maps").Contains("libcorsnap_agent");
        Console.WriteLine("spawned " + Environment.ProcessId + " agent-mapped " + (mapped ? "yes" : "no"));
        Burn(seconds);
        double cpu = Process.GetCurrentProcess().TotalProcessorTime.TotalMilliseconds;
        Console.WriteLine("spawned cpu-ms " + cpu.ToString("F0", CultureInfo.InvariantCulture));
        return 0;
    }
}
