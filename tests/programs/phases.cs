// Test program: one thread in three phases whose shares it measures itself.
//
//   dotnet phases.dll [seconds=3]
//
// Phases.Trig calls Math.Sin and Math.Exp (the runtime cannot stop a thread
// inside libm at once, so a suspending sampler charges this time elsewhere),
// Phases.Build concatenates and allocates strings, Phases.Parse parses
// integers. Each phase runs for a set slice of Stopwatch time per round
// (6 : 2.5 : 1.5); the program adds up the CPU time each phase really took
// (its thread's CPU clock, read at each phase's ends) and prints
//   share trig=<0..1> build=<0..1> parse=<0..1>
// then the same shares by elapsed time ("wall trig=..."), then
// "done <checksum>" and exits 0. A CPU profile is held to the CPU shares: on
// a loaded machine the thread is preempted, and elapsed time is not CPU
// time (54/24/22 by elapsed time seen in CI, against 60/25/15 set).
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Text;

public static class Phases
{
    public static volatile int s_sink;
    static double s_acc = 1.0;
    static readonly string[] s_numbers = MakeNumbers();

    static string[] MakeNumbers()
    {
        var numbers = new string[256];
        for (int i = 0; i < numbers.Length; i++)
            numbers[i] = (i * 7919 + 13).ToString(CultureInfo.InvariantCulture);
        return numbers;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Trig(long until)
    {
        double x = s_acc;
        do
        {
            for (int i = 0; i < 256; i++)
            {
                x = Math.Sin(x) + Math.Exp(-x * x) + 0.5;
            }
        } while (Stopwatch.GetTimestamp() < until);
        s_acc = x;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Build(long until)
    {
        int total = 0;
        do
        {
            var sb = new StringBuilder();
            for (int i = 0; i < 64; i++)
            {
                sb.Append("item-").Append(i).Append(';');
            }
            string s = sb.ToString() + s_acc.ToString(CultureInfo.InvariantCulture);
            total += s.Length;
        } while (Stopwatch.GetTimestamp() < until);
        s_sink = total;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static void Parse(long until)
    {
        long total = 0;
        do
        {
            for (int i = 0; i < s_numbers.Length; i++)
            {
                total += int.Parse(s_numbers[i], NumberStyles.Integer, CultureInfo.InvariantCulture);
            }
        } while (Stopwatch.GetTimestamp() < until);
        s_sink = (int)total;
    }

    [StructLayout(LayoutKind.Sequential)]
    struct Timespec
    {
        public long Seconds;
        public long Nanoseconds;
    }

    [DllImport("libc.so.6")]
    static extern int clock_gettime(int clock, out Timespec time);

    // CLOCK_THREAD_CPUTIME_ID: this thread's CPU time, in nanoseconds.
    static long ThreadCpuNs()
    {
        clock_gettime(3, out Timespec t);
        return t.Seconds * 1_000_000_000 + t.Nanoseconds;
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
        long freq = Stopwatch.Frequency;
        long deadline = Stopwatch.GetTimestamp() + (long)(seconds * freq);
        long trig = 0, build = 0, parse = 0;
        long trigCpu = 0, buildCpu = 0, parseCpu = 0;
        while (Stopwatch.GetTimestamp() < deadline)
        {
            long c0 = ThreadCpuNs();
            long t0 = Stopwatch.GetTimestamp();
            Trig(t0 + freq * 6 / 1000);
            long c1 = ThreadCpuNs();
            long t1 = Stopwatch.GetTimestamp();
            Build(t1 + freq * 25 / 10000);
            long c2 = ThreadCpuNs();
            long t2 = Stopwatch.GetTimestamp();
            Parse(t2 + freq * 15 / 10000);
            long c3 = ThreadCpuNs();
            long t3 = Stopwatch.GetTimestamp();
            trig += t1 - t0;
            build += t2 - t1;
            parse += t3 - t2;
            trigCpu += c1 - c0;
            buildCpu += c2 - c1;
            parseCpu += c3 - c2;
        }
        double cpu = trigCpu + buildCpu + parseCpu;
        Console.WriteLine(string.Format(CultureInfo.InvariantCulture, "share trig={0:F4} build={1:F4} parse={2:F4}",
            trigCpu / cpu, buildCpu / cpu, parseCpu / cpu));
        double all = trig + build + parse;
        Console.WriteLine(string.Format(CultureInfo.InvariantCulture, "wall trig={0:F4} build={1:F4} parse={2:F4}",
            trig / all, build / all, parse / all));
        Console.WriteLine("done " + s_sink.ToString(CultureInfo.InvariantCulture));
        return 0;
    }
}
