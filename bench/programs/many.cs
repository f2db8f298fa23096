// A 50-thread process: each thread does a little work, calls a rotating set
// of methods and sleeps, for a number of seconds; prints its own peak
// resident memory at the end is not needed (the benchmark reads /proc).
//   dotnet many.dll THREADS SECONDS
using System;
using System.Diagnostics;
using System.Runtime.CompilerServices;
using System.Threading;

public static class Many
{
    static volatile bool s_stop;
    public static long s_sink;

    [MethodImpl(MethodImplOptions.NoInlining)] static long A(long x) { for (int i = 0; i < 2000; i++) x = x * 31 + i; return x; }
    [MethodImpl(MethodImplOptions.NoInlining)] static long B(long x) { return A(x) ^ A(x + 1); }
    [MethodImpl(MethodImplOptions.NoInlining)] static long C(long x) { return B(x) + A(x); }

    static void Work(object o)
    {
        long x = (int)o;
        while (!s_stop)
        {
            x = (x % 3 == 0) ? A(x) : (x % 3 == 1) ? B(x) : C(x);
            Thread.Sleep(5);
        }
        Interlocked.Add(ref s_sink, x & 1);
    }

    public static int Main(string[] args)
    {
        int threads = int.Parse(args[0]);
        double seconds = double.Parse(args[1], System.Globalization.CultureInfo.InvariantCulture);
        var all = new Thread[threads];
        for (int i = 0; i < threads; i++) { all[i] = new Thread(Work) { Name = "worker-" + i }; all[i].Start(i); }
        Console.WriteLine("ready " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        Thread.Sleep(TimeSpan.FromSeconds(seconds));
        s_stop = true;
        foreach (var t in all) t.Join();
        Console.WriteLine("done " + s_sink);
        return 0;
    }
}
