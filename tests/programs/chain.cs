// Test program: stacks a frame-pointer walk gets wrong.
//
//   dotnet chain.dll [seconds=3]
//
// For the first half, Main -> Chain.Run -> L1 -> L2 -> L3 -> L4 -> L5 -> Hot:
// small methods with one call each, which Tier1 (and full opts) compile
// without a frame pointer, so a walk by frame pointers loses their callers.
// For the second half, Main -> Chain.Spin -> Leaf, where Spin is called once
// and loops: on-stack replacement moves its loop into an OSR body whose
// frame sits on top of the Tier0 one.
// Prints "done <checksum>" and "main_cpu_ms <n>" (the CPU the main thread
// used in Main, as the kernel counts it: the truth a CPU profile's total is
// held to, since on a busy host a run of N seconds gets less than N seconds
// of CPU) and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;

public static class Chain
{
    public static volatile int s_sink;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int Hot(int n)
    {
        int s = 0;
        for (int i = 0; i < n; i++) s += i * i ^ (s >> 3);
        return s;
    }

    [MethodImpl(MethodImplOptions.NoInlining)] static int L5(int n) { return Hot(n) + 1; }
    [MethodImpl(MethodImplOptions.NoInlining)] static int L4(int n) { return L5(n) + 1; }
    [MethodImpl(MethodImplOptions.NoInlining)] static int L3(int n) { return L4(n) + 1; }
    [MethodImpl(MethodImplOptions.NoInlining)] static int L2(int n) { return L3(n) + 1; }
    [MethodImpl(MethodImplOptions.NoInlining)] static int L1(int n) { return L2(n) + 1; }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Run(long until)
    {
        int acc = 0;
        while (Stopwatch.GetTimestamp() < until)
        {
            acc += L1(20000);
        }
        s_sink = acc;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int Leaf(int x)
    {
        for (int i = 0; i < 2000; i++) x = x * 1103515245 + 12345;
        return x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Spin(long until)
    {
        int x = 1;
        long checks = 0;
        while (true)
        {
            x = Leaf(x);
            if ((++checks & 63) == 0 && Stopwatch.GetTimestamp() >= until) break;
        }
        s_sink = x;
    }

    public static int Main(string[] args)
    {
        long cpuAtStart = ThreadCpuMs();
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
        long freq = Stopwatch.Frequency;
        long start = Stopwatch.GetTimestamp();
        Run(start + (long)(seconds / 2 * freq));
        Spin(start + (long)(seconds * freq));
        Console.WriteLine("done " + s_sink.ToString(CultureInfo.InvariantCulture));
        Console.WriteLine("main_cpu_ms " + (ThreadCpuMs() - cpuAtStart).ToString(CultureInfo.InvariantCulture));
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
