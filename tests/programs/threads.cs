// Test program: three named threads, each spinning in its own method.
//
//   dotnet threads.dll [seconds=3]
//
// worker-1 runs Workers.Alpha, worker-2 Workers.Beta, worker-3 Workers.Gamma;
// the main thread waits in Join. Prints "done <checksum>" and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Threading;

public static class Workers
{
    static long s_deadline;
    static ulong s_alpha, s_beta, s_gamma;
    public static volatile int s_sink;

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Alpha()
    {
        ulong x = 1;
        do
        {
            for (int i = 0; i < 1024; i++)
            {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x += 1;
            }
            s_sink = (int)x;
        } while (Stopwatch.GetTimestamp() < s_deadline);
        s_alpha = x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Beta()
    {
        ulong x = 2;
        do
        {
            for (int i = 0; i < 1024; i++)
            {
                x = x * 6364136223846793005UL + 1442695040888963407UL;
            }
            s_sink = (int)x;
        } while (Stopwatch.GetTimestamp() < s_deadline);
        s_beta = x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Gamma()
    {
        ulong x = 3;
        do
        {
            for (int i = 0; i < 1024; i++)
            {
                x = (x >> 1) ^ (0xD800000000000000UL & (0UL - (x & 1))) ^ (ulong)i;
            }
            s_sink = (int)x;
        } while (Stopwatch.GetTimestamp() < s_deadline);
        s_gamma = x;
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
        s_deadline = Stopwatch.GetTimestamp() + (long)(seconds * Stopwatch.Frequency);

        Thread[] threads =
        {
            new Thread(Alpha) { Name = "worker-1" },
            new Thread(Beta) { Name = "worker-2" },
            new Thread(Gamma) { Name = "worker-3" },
        };
        foreach (Thread t in threads) t.Start();
        foreach (Thread t in threads) t.Join();

        ulong sum = s_alpha + s_beta + s_gamma;
        Console.WriteLine("done " + sum.ToString(CultureInfo.InvariantCulture));
        return 0;
    }
}
