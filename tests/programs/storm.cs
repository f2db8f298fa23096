// Torture workloads, each for a number of seconds, each ending with one line
// that says what it survived, and exit code 0:
//   dotnet storm.dll churn SECONDS       -- thousands of short-lived threads a second
//   dotnet storm.dll gc SECONDS          -- threads allocating hard, forced and background GCs,
//                                           and a stream of freshly JIT-compiled generic methods
//   dotnet storm.dll exceptions SECONDS  -- exceptions thrown and caught on many threads
//   dotnet storm.dll all SECONDS         -- all three at once, printing "ready <pid>" first
// With "all", a heartbeat line is printed every 100 ms.
using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Runtime.CompilerServices;
using System.Threading;

public static class Storm
{
    static volatile bool s_stop;
    static long s_threads, s_exceptions, s_allocated, s_jitted;
    public static object s_keep;

    static void Churn()
    {
        var batch = new Thread[32];
        while (!s_stop)
        {
            for (int i = 0; i < batch.Length; i++)
            {
                batch[i] = new Thread(ShortLife);
                batch[i].Start();
            }
            foreach (var t in batch) t.Join();
            Interlocked.Add(ref s_threads, batch.Length);
        }
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void ShortLife()
    {
        ulong h = 1;
        for (int i = 0; i < 200; i++) { h ^= h << 13; h ^= h >> 7; h ^= h << 17; }
        if (h == 42) Console.WriteLine("never");
    }

    sealed class Box<T> { public T Value; public Box<T> Next; }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static object Make<T>(T value, int n)
    {
        Box<T> head = null;
        for (int i = 0; i < n; i++) head = new Box<T> { Value = value, Next = (i % 32 == 0) ? null : head };
        return head;
    }

    static void Allocate(int seed)
    {
        var rng = new Random(seed);
        while (!s_stop)
        {
            s_keep = Make(rng.Next(), 500);
            s_keep = Make("s" + rng.Next(100), 200);
            s_keep = new byte[rng.Next(100, 120_000)]; // some on the large object heap
            Interlocked.Add(ref s_allocated, 1);
        }
    }

    static void Collect()
    {
        int round = 0;
        while (!s_stop)
        {
            Thread.Sleep(20);
            if (round++ % 2 == 0) GC.Collect();
            else GC.Collect(2, GCCollectionMode.Forced, false); // background
        }
    }

    // Each call compiles new generic instantiations, so the sampler keeps
    // meeting new FunctionIDs to name while collections run.
    static void Jit()
    {
        var types = new[] { typeof(int), typeof(long), typeof(string), typeof(double), typeof(byte), typeof(char), typeof(short), typeof(Guid) };
        var method = typeof(Storm).GetMethod("Generic", System.Reflection.BindingFlags.NonPublic | System.Reflection.BindingFlags.Static);
        int i = 0;
        while (!s_stop && i < 4096)
        {
            var a = types[i % types.Length];
            var b = types[(i / types.Length) % types.Length];
            var c = types[(i / 64) % types.Length];
            method.MakeGenericMethod(a, b, c).Invoke(null, null);
            Interlocked.Increment(ref s_jitted);
            i++;
            Thread.Sleep(1);
        }
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int Generic<A, B, C>() { return typeof(A).Name.Length + typeof(B).Name.Length + typeof(C).Name.Length; }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Fail(int depth)
    {
        if (depth == 0) throw new InvalidOperationException("storm");
        Fail(depth - 1);
    }

    static void Throw()
    {
        while (!s_stop)
        {
            try { Fail(3); } catch (InvalidOperationException) { Interlocked.Increment(ref s_exceptions); }
        }
    }

    public static int Main(string[] args)
    {
        string kind = args[0];
        double seconds = double.Parse(args[1], System.Globalization.CultureInfo.InvariantCulture);
        var workers = new List<Thread>();
        Action<ThreadStart, string> start = (body, name) => { var t = new Thread(body) { Name = name }; t.Start(); workers.Add(t); };
        bool all = kind == "all";
        if (kind == "churn" || all) { start(Churn, "churn-1"); start(Churn, "churn-2"); }
        if (kind == "gc" || all)
        {
            for (int i = 0; i < 3; i++) { int seed = i; start(() => Allocate(seed), "alloc-" + i); }
            start(Collect, "collector");
            start(Jit, "jitter");
        }
        if (kind == "exceptions" || all) { for (int i = 0; i < 4; i++) start(Throw, "thrower-" + i); }
        // Readiness: the storms have started (every mode, for tests that must
        // not act before the program works).
        Console.WriteLine("ready " + Process.GetCurrentProcess().Id); Console.Out.Flush();
        var sw = Stopwatch.StartNew();
        long beat = 0;
        while (sw.Elapsed.TotalSeconds < seconds)
        {
            Thread.Sleep(100);
            if (all) { Console.WriteLine("heartbeat " + (++beat)); Console.Out.Flush(); }
        }
        s_stop = true;
        foreach (var t in workers) t.Join();
        Console.WriteLine("survived threads=" + s_threads + " gcs=" + GC.CollectionCount(0) + " gen2=" + GC.CollectionCount(2)
            + " exceptions=" + s_exceptions + " allocations=" + s_allocated + " jitted=" + s_jitted);
        return 0;
    }
}
