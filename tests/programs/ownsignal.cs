// Test program: takes SIGPROF for itself halfway through.
//
//   dotnet ownsignal.dll [seconds=2]
//
// Spins for half the time, then sets SIGPROF to be ignored (as a program
// with a profiler of its own, or a library that wants the signal, would
// replace its handler), spins for the other half, prints "done" and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.InteropServices;

public static class OwnSignal
{
    [DllImport("libc")]
    static extern IntPtr signal(int signum, IntPtr handler);

    const int SIGPROF = 27;
    public static volatile int s_sink;

    static void Spin(double seconds)
    {
        var sw = Stopwatch.StartNew();
        ulong x = 1;
        while (sw.Elapsed.TotalSeconds < seconds)
        {
            for (int i = 0; i < 100000; i++) x = x * 6364136223846793005UL + 1;
            s_sink = (int)x;
        }
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 2.0;
        Spin(seconds / 2);
        signal(SIGPROF, (IntPtr)1); // SIG_IGN
        Spin(seconds / 2);
        Console.WriteLine("done");
        return 0;
    }
}
