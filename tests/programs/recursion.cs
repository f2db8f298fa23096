// Test program: a stack with exactly 200 (or `depth`) Deep.Recurse frames
// above Main, with the innermost one spinning in Deep.Bottom.
//
//   dotnet recursion.dll [seconds=3] [depth=200]
//
// Prints "done <checksum>" and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;

public static class Deep
{
    public static int MaxDepth = 200;

    static long s_deadline;
    public static volatile int s_sink;
    static ulong s_acc;

    // Recurse(1) -> Recurse(2) -> ... -> Recurse(200) -> Bottom().
    // The work after the recursive call keeps it from being a tail call.
    [MethodImpl(MethodImplOptions.NoInlining)]
    public static ulong Recurse(int depth)
    {
        ulong r = depth < MaxDepth ? Recurse(depth + 1) : Bottom();
        r = r * 31 + (ulong)depth;
        s_sink = (int)r;
        return r;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static ulong Bottom()
    {
        ulong x = 0x2545F4914F6CDD1DUL;
        do
        {
            for (int i = 0; i < 1024; i++)
            {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
            }
            s_acc += x;
        } while (Stopwatch.GetTimestamp() < s_deadline);
        return s_acc;
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
        if (args.Length > 1) MaxDepth = int.Parse(args[1], CultureInfo.InvariantCulture);
        s_deadline = Stopwatch.GetTimestamp() + (long)(seconds * Stopwatch.Frequency);
        ulong r = Recurse(1);
        Console.WriteLine("done " + r.ToString(CultureInfo.InvariantCulture));
        return 0;
    }
}
