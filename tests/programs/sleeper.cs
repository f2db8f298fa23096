// One thread spinning, one sleeping: a CPU profile shows only the first, a
// wall-clock profile both.
//   dotnet sleeper.dll [seconds, default 2]
using System;
using System.Diagnostics;
using System.Runtime.CompilerServices;
using System.Threading;

public static class Sleeper
{
    public static long s_sink;
    static double s_seconds;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Spin()
    {
        var sw = Stopwatch.StartNew();
        ulong h = 1;
        while (sw.Elapsed.TotalSeconds < s_seconds)
        {
            for (int i = 0; i < 1000; i++) { h ^= h << 13; h ^= h >> 7; h ^= h << 17; }
        }
        Interlocked.Add(ref s_sink, (long)(h & 0xff));
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
        Console.WriteLine("done " + s_sink);
        return 0;
    }
}
