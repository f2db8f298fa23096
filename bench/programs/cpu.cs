// A fixed amount of CPU-bound work on N threads; prints how long the work
// took (runtime start-up excluded), so profilers are compared on the work.
//   dotnet cpu.dll THREADS ITERATIONS_PER_THREAD
using System;
using System.Diagnostics;
using System.Runtime.CompilerServices;
using System.Threading;

public static class Cpu
{
    public static long s_sink;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong Mix(ulong h, int rounds)
    {
        for (int i = 0; i < rounds; i++)
        {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
        }
        return h;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong Level2(ulong h) { return Mix(h, 64) + 1; }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong Level1(ulong h) { return Level2(h) ^ Mix(h, 16); }

    static void Work(long iterations)
    {
        ulong h = 88172645463325252UL;
        for (long i = 0; i < iterations; i++)
            h = Level1(h);
        Interlocked.Add(ref s_sink, (long)(h & 0xff));
    }

    public static int Main(string[] args)
    {
        int threads = args.Length > 0 ? int.Parse(args[0]) : 1;
        long iterations = args.Length > 1 ? long.Parse(args[1]) : 10000000;
        Work(1000); // JIT everything before the clock starts
        var sw = Stopwatch.StartNew();
        var all = new Thread[threads];
        for (int t = 0; t < threads; t++)
        {
            all[t] = new Thread(() => Work(iterations));
            all[t].Name = "busy-" + (t + 1);
            all[t].Start();
        }
        foreach (var t in all) t.Join();
        Console.WriteLine("elapsed_ms " + sw.Elapsed.TotalMilliseconds.ToString("F1", System.Globalization.CultureInfo.InvariantCulture));
        return 0;
    }
}
