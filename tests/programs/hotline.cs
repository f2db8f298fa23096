// Source lines (`--lines`): a hot loop on one line, called from one line,
// so that every sample of `Spin` belongs to the first marked line and every
// sample of `Main` under it to the second. The test finds the lines by
// their markers. Argument: seconds to run (default 1.5).
using System;
using System.Diagnostics;
using System.Runtime.CompilerServices;

static class HotLine
{
    [MethodImpl(MethodImplOptions.NoInlining)]
    static double Spin(int n)
    {
        double x = 0;
        for (int i = 0; i < n; i++) x += Math.Sqrt(i) * 1.0000001; // corsnap-test: hot loop
        return x;
    }

    static void Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], System.Globalization.CultureInfo.InvariantCulture) : 1.5;
        var clock = Stopwatch.StartNew();
        double total = 0;
        while (clock.Elapsed.TotalSeconds < seconds)
        {
            total += Spin(2_000_000); // corsnap-test: call
        }
        Console.WriteLine(total > 0 ? "done" : "nothing");
    }
}
