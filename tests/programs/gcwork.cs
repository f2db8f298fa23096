// Test program: garbage collections that take real work, so the runtime's
// own GC threads use CPU (run with DOTNET_gcServer=1 for server GC threads).
//
//   dotnet gcwork.dll [seconds=2]
//
// Keeps about a million small objects alive in a tree and, while the time
// lasts, replaces parts of it and allocates garbage, with a full blocking
// collection every 100 ms. Prints "done <collections>" and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;

public static class GcWork
{
    sealed class Node { public Node Left, Right; public long Value; }

    static Node Build(int depth, long seed)
    {
        if (depth == 0) return new Node { Value = seed };
        return new Node { Left = Build(depth - 1, seed * 2), Right = Build(depth - 1, seed * 2 + 1), Value = seed };
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 2.0;
        var sw = Stopwatch.StartNew();
        var roots = new Node[16];
        for (int i = 0; i < roots.Length; i++) roots[i] = Build(16, i);
        long nextFull = 100;
        int round = 0;
        object garbage = null;
        while (sw.Elapsed.TotalSeconds < seconds)
        {
            roots[round++ % roots.Length] = Build(14, round);
            for (int i = 0; i < 20000; i++) garbage = new byte[64];
            if (sw.ElapsedMilliseconds >= nextFull)
            {
                GC.Collect(2, GCCollectionMode.Forced, true);
                nextFull += 100;
            }
        }
        GC.KeepAlive(garbage);
        Console.WriteLine("done " + GC.CollectionCount(2).ToString(CultureInfo.InvariantCulture));
        return 0;
    }
}
