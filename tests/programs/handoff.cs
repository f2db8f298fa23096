// Test program: two threads that hand work to each other thousands of times
// a second (each blocks in a wait at every handoff, as a server's I/O and
// thread-pool threads do), beside one thread that computes without blocking.
//
//   dotnet handoff.dll [seconds=4]
//
// Threads: "handoff-ping" and "handoff-pong" (Handoff.Ping / Handoff.Pong,
// each doing Handoff.Small between waits), "crunch" (Handoff.Crunch). Each
// thread measures its own CPU time (CLOCK_THREAD_CPUTIME_ID). Prints
// "handoffs <n> crunch <checksum>", then "share crunch=<share> ping=<share>
// pong=<share>" (shares of the three threads' CPU time), and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;

public static class Handoff
{
    static readonly AutoResetEvent s_toPong = new AutoResetEvent(false);
    static readonly AutoResetEvent s_toPing = new AutoResetEvent(false);
    static volatile bool s_stop;
    static long s_handoffs;
    public static volatile int s_sink;
    static long s_pingNs, s_pongNs, s_crunchNs;

    [StructLayout(LayoutKind.Sequential)]
    struct Timespec { public long Sec; public long Nsec; }

    [DllImport("libc", EntryPoint = "clock_gettime")]
    static extern int ClockGetTime(int clock, out Timespec ts);

    // This thread's CPU time so far (CLOCK_THREAD_CPUTIME_ID).
    static long ThreadCpuNs()
    {
        ClockGetTime(3, out var ts);
        return ts.Sec * 1_000_000_000 + ts.Nsec;
    }

    // About 20 µs of arithmetic.
    [MethodImpl(MethodImplOptions.NoInlining)]
    public static ulong Small(ulong x)
    {
        for (int i = 0; i < 20000; i++)
        {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        return x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Ping()
    {
        ulong x = 1;
        while (!s_stop)
        {
            x = Small(x);
            s_toPong.Set();
            s_toPing.WaitOne();
            Interlocked.Increment(ref s_handoffs);
        }
        s_toPong.Set();
        s_sink = (int)x;
        s_pingNs = ThreadCpuNs();
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Pong()
    {
        ulong x = 2;
        while (!s_stop)
        {
            s_toPong.WaitOne();
            x = Small(x);
            s_toPing.Set();
        }
        s_toPing.Set();
        s_sink = (int)x;
        s_pongNs = ThreadCpuNs();
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static ulong Crunch()
    {
        ulong x = 3;
        while (!s_stop)
        {
            for (int i = 0; i < 1024; i++)
            {
                x = x * 6364136223846793005UL + 1442695040888963407UL;
            }
        }
        s_crunchNs = ThreadCpuNs();
        return x;
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 4.0;
        ulong crunched = 0;
        var ping = new Thread(Ping) { Name = "handoff-ping" };
        var pong = new Thread(Pong) { Name = "handoff-pong" };
        var crunch = new Thread(() => crunched = Crunch()) { Name = "crunch" };
        pong.Start();
        ping.Start();
        crunch.Start();
        Thread.Sleep(TimeSpan.FromSeconds(seconds));
        s_stop = true;
        ping.Join();
        pong.Join();
        crunch.Join();
        Console.WriteLine($"handoffs {Interlocked.Read(ref s_handoffs)} crunch {crunched}");
        double total = s_crunchNs + s_pingNs + s_pongNs;
        Console.WriteLine(string.Format(CultureInfo.InvariantCulture, "share crunch={0:F4} ping={1:F4} pong={2:F4}",
            s_crunchNs / total, s_pingNs / total, s_pongNs / total));
        return 0;
    }
}
