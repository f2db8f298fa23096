// Test program: a thread the runtime keeps having to stop for collections
// while it runs code it cannot be stopped in at once.
//
//   dotnet gcstop.dll [seconds=3]
//
// One thread allocates garbage without pause, so collections follow each
// other. The main thread runs GcStop.Straight: a loop of long straight-line
// arithmetic around one call. Code like that can only be stopped at the call,
// so for each collection the runtime replaces Straight's return address with
// a trampoline of its own (a "hijack") and lets it run on to the call; a walk
// that takes the trampoline for the caller loses GcStop.Main.
// Prints "done <checksum>" and exits 0.
using System;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Threading;

public static class GcStop
{
    static volatile bool s_stop;
    public static object s_garbage;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static long Leaf(long x)
    {
        for (int i = 0; i < 50; i++) x = x * 31 + i;
        return x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static long Straight(long x)
    {
        while (!s_stop)
        {
            x = Leaf(x);
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
            x = x * 1103515245 + 12345; x ^= x >> 7; x = x * 1103515245 + 12345; x ^= x >> 7;
        }
        return x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Churn()
    {
        while (!s_stop)
        {
            for (int i = 0; i < 1000; i++) s_garbage = new byte[1000];
        }
    }

    public static void Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3;
        var churn = new Thread(Churn);
        churn.Start();
        var timer = new Thread(() => { Thread.Sleep((int)(seconds * 1000)); s_stop = true; });
        timer.Start();
        long result = Straight(7);
        churn.Join();
        timer.Join();
        Console.WriteLine("done " + result);
    }
}
