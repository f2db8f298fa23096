// Test program: takes SIGPROF for itself halfway through.
//
//   dotnet ownsignal.dll [seconds=2]
//
// Spins for half the time, then sets SIGPROF to be ignored (as a program
// with a profiler of its own, or a library that wants the signal, would
// replace its handler), spins for the other half, prints "done" and exits 0.
// After the first half it prints "first_half_cpu_ms <n>": the CPU the main
// thread used in it, as the kernel counts it (on a busy host a second of
// spinning gets less than a second of CPU).
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.InteropServices;

public static class OwnSignal
{
    [DllImport("libc")]
    static extern IntPtr signal(int signum, IntPtr handler);

    const int SIGPROF = 27;
    public static volatile int s_sink;

    static void Spin(double seconds)
    {
        var sw = Stopwatch.StartNew();
        ulong x = 1;
        while (sw.Elapsed.TotalSeconds < seconds)
        {
            for (int i = 0; i < 100000; i++) x = x * 6364136223846793005UL + 1;
            s_sink = (int)x;
        }
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 2.0;
        long cpuAtStart = ThreadCpuMs();
        Spin(seconds / 2);
        Console.WriteLine("first_half_cpu_ms " + (ThreadCpuMs() - cpuAtStart).ToString(CultureInfo.InvariantCulture));
        signal(SIGPROF, (IntPtr)1); // SIG_IGN
        Spin(seconds / 2);
        Console.WriteLine("done");
        return 0;
    }

    // The calling thread's user and system time from /proc/thread-self/stat
    // (fields 14 and 15, in clock ticks of 10 ms).
    static long ThreadCpuMs()
    {
        string stat = System.IO.File.ReadAllText("/proc/thread-self/stat");
        string[] fields = stat.Substring(stat.LastIndexOf(')') + 2).Split(' ');
        return (long.Parse(fields[11], CultureInfo.InvariantCulture) + long.Parse(fields[12], CultureInfo.InvariantCulture)) * 10;
    }
}
