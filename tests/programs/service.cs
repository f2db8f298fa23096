// A long-running "service" to attach to: a named worker thread busy in
// Service.Crunch, and the main thread printing a heartbeat line every 100 ms
// (so tests can see it keeps running, with its output intact, while corsnap
// attaches and detaches). Prints "ready <pid>" once everything runs.
//   dotnet service.dll [seconds, default 60]
using System;
using System.Diagnostics;
using System.Runtime.CompilerServices;
using System.Threading;

public static class Service
{
    public static long s_sink;
    static volatile bool s_stop;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong Crunch(ulong h)
    {
        for (int i = 0; i < 4096; i++)
        {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
        }
        return h;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void WorkLoop()
    {
        ulong h = 88172645463325252UL;
        while (!s_stop)
            h = Crunch(h);
        Interlocked.Add(ref s_sink, (long)(h & 0xff));
    }

    // Throws and catches one exception per heartbeat, for attach tests of
    // the exception profile.
    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Beat(long beat)
    {
        try { throw new InvalidOperationException("beat " + beat); }
        catch (InvalidOperationException) { Interlocked.Increment(ref s_sink); }
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], System.Globalization.CultureInfo.InvariantCulture) : 60;
        var worker = new Thread(WorkLoop);
        worker.Name = "cruncher";
        worker.Start();
        Console.WriteLine("ready " + Process.GetCurrentProcess().Id);
        Console.Out.Flush();
        var sw = Stopwatch.StartNew();
        long beat = 0;
        while (sw.Elapsed.TotalSeconds < seconds)
        {
            Thread.Sleep(100);
            Beat(++beat);
            Console.WriteLine("heartbeat " + beat);
            Console.Out.Flush();
        }
        s_stop = true;
        worker.Join();
        Console.WriteLine("done " + s_sink);
        return 0;
    }
}
