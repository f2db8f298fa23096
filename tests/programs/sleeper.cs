// One thread spinning, one sleeping: a CPU profile shows only the first, a
// wall-clock profile both. Prints the CPU time the spinner had (the
// kernel's count for its thread), which a loaded machine makes less than
// its wall-clock time.
//   dotnet sleeper.dll [seconds, default 2]
using System;
using System.Diagnostics;
using System.Runtime.CompilerServices;
using System.Threading;

public static class Sleeper
{
    public static long s_sink;
    static double s_seconds;
    static long s_spinCpuNs;

    /// The calling thread's CPU time so far, in nanoseconds (the first field
    /// of its schedstat).
    static long ThreadCpuNs() =>
        long.Parse(System.IO.File.ReadAllText("/proc/thread-self/schedstat").Split(' ')[0], System.Globalization.CultureInfo.InvariantCulture);

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Spin()
    {
        long cpu = ThreadCpuNs();
        var sw = Stopwatch.StartNew();
        ulong h = 1;
        while (sw.Elapsed.TotalSeconds < s_seconds)
        {
            for (int i = 0; i < 1000; i++) { h ^= h << 13; h ^= h >> 7; h ^= h << 17; }
        }
        Interlocked.Add(ref s_sink, (long)(h & 0xff));
        s_spinCpuNs = ThreadCpuNs() - cpu;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Doze()
    {
        var sw = Stopwatch.StartNew();
        while (sw.Elapsed.TotalSeconds < s_seconds)
            Thread.Sleep(20);
    }

    public static int Main(string[] args)
    {
        s_seconds = args.Length > 0 ? double.Parse(args[0], System.Globalization.CultureInfo.InvariantCulture) : 2;
        var spinner = new Thread(Spin) { Name = "spinner" };
        var sleeper = new Thread(Doze) { Name = "sleeper" };
        spinner.Start();
        sleeper.Start();
        spinner.Join();
        sleeper.Join();
        Console.WriteLine("spinner_cpu_ns " + s_spinCpuNs);
        Console.WriteLine("done " + s_sink);
        return 0;
    }
}
