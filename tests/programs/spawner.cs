// Test program: starts a child .NET process and burns CPU beside it.
//
//   dotnet spawner.dll CHILD.dll [seconds=2]
//
// Runs `<this dotnet> CHILD.dll seconds` (Process.Start, inheriting the
// environment, as programs do), spins in Spawner.Burn for `seconds`, waits
// for the child, then prints "spawner cpu-ms <its own CPU time>" and exits
// with the child's exit code.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;

public static class Spawner
{
    public static volatile int s_sink;
    static ulong s_acc = 0x9E3779B97F4A7C15UL;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Burn(double seconds)
    {
        var sw = Stopwatch.StartNew();
        ulong x = s_acc | 1;
        while (sw.Elapsed.TotalSeconds < seconds)
        {
            for (int i = 0; i < 4096; i++)
            {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
            }
        }
        s_acc += x;
        s_sink = (int)x;
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 1 ? double.Parse(args[1], CultureInfo.InvariantCulture) : 2;
        var start = new ProcessStartInfo(Environment.ProcessPath!) { UseShellExecute = false };
        start.ArgumentList.Add(args[0]);
        start.ArgumentList.Add(seconds.ToString(CultureInfo.InvariantCulture));
        using var child = Process.Start(start)!;
        Burn(seconds);
        child.WaitForExit();
        double cpu = Process.GetCurrentProcess().TotalProcessorTime.TotalMilliseconds;
        Console.WriteLine("spawner cpu-ms " + cpu.ToString("F0", CultureInfo.InvariantCulture));
        return child.ExitCode;
    }
}
