// Test program: CPU time splits 3:1 between Split.Heavy and Split.Light.
//
//   dotnet split.dll [seconds=3]
//
// The main thread alternates Heavy for ~3 ms and Light for ~1 ms (measured with
// Stopwatch) until the deadline, then prints "done <checksum>" and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;

public static class Split
{
    public static volatile int s_sink;
    static ulong s_acc = 0x9E3779B97F4A7C15UL;

    // Spins in ~1k-iteration chunks until Stopwatch reaches `until`.
    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Heavy(long until)
    {
        ulong x = s_acc | 1;
        do
        {
            for (int i = 0; i < 1024; i++)
            {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
            }
        } while (Stopwatch.GetTimestamp() < until);
        s_acc += x;
        s_sink = (int)x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Light(long until)
    {
        ulong x = s_acc | 1;
        do
        {
            for (int i = 0; i < 1024; i++)
            {
                x = x * 6364136223846793005UL + 1442695040888963407UL;
            }
        } while (Stopwatch.GetTimestamp() < until);
        s_acc ^= x;
        s_sink = (int)x;
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
        long freq = Stopwatch.Frequency;
        long heavyTicks = freq * 3 / 1000;
        long lightTicks = freq / 1000;
        long deadline = Stopwatch.GetTimestamp() + (long)(seconds * freq);

        while (Stopwatch.GetTimestamp() < deadline)
        {
            Heavy(Stopwatch.GetTimestamp() + heavyTicks);
            Light(Stopwatch.GetTimestamp() + lightTicks);
        }

        Console.WriteLine("done " + s_acc.ToString(CultureInfo.InvariantCulture));
        return 0;
    }
}
