// Test program: thread-pool work written the way services are written, in
// the C# people write today (top-level statements, records, generics,
// Span<T>, LINQ, lambdas and closures, local functions, async/await).
//
//   dotnet pool.dll [seconds=3]
//
// The top-level statements run an async loop: each round queues two work
// items with Task.Run and awaits both (Task.WhenAll), so every round's work
// runs on thread-pool workers and the loop itself resumes on the pool. Each
// work item (Work.Round) runs three phases, each for a set slice of
// Stopwatch time (3 : 2 : 1.5 ms):
//   Work.Shapes     calls IShape.Area through an interface with five
//                   implementations (records), each a loop over a Span<double>
//                   summed by a generic INumber<T> helper;
//   Work.Delegates  calls closures (Func<double, double>) over the round's
//                   locals, and a local function;
//   Work.Query      runs a LINQ chain (Where, GroupBy, Select, Sum,
//                   OrderByDescending) over an array of records.
// The program adds up what each phase really took, on both workers, in CPU
// time (the thread's own CPU clock: on a machine with more runnable threads
// than cores, a phase's Stopwatch time includes time the thread was not
// running, which a CPU profile rightly does not show), and prints
//   share shapes=<0..1> delegates=<0..1> query=<0..1>
//   wallshare shapes=<0..1> delegates=<0..1> query=<0..1>   (Stopwatch time)
// then "done <checksum>" and exits 0.
#nullable enable
using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Globalization;
using System.Linq;
using System.Numerics;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;
using System.Threading.Tasks;

double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
long freq = Stopwatch.Frequency;
long deadline = Stopwatch.GetTimestamp() + (long)(seconds * freq);
var totals = new PhaseTotals();
var wall = new PhaseTotals();
var shapes = Catalog.Shapes();
var orders = Catalog.Orders(512);
int rounds = 0;

while (Stopwatch.GetTimestamp() < deadline)
{
    // Each worker gets its own copy of the round's parameters (a closure).
    int round = rounds++;
    await Task.WhenAll(
        Task.Run(() => Work.Round(0, round, shapes, orders, totals, wall)),
        Task.Run(() => Work.Round(1, round, shapes, orders, totals, wall)));
}

Console.WriteLine(Report("share", totals));
Console.WriteLine(Report("wallshare", wall));
Console.WriteLine("done " + (Work.Checksum + rounds).ToString(CultureInfo.InvariantCulture));
return 0;

static string Report(string what, PhaseTotals t)
{
    double all = t.Shapes + t.Delegates + t.Query;
    return string.Format(CultureInfo.InvariantCulture, "{0} shapes={1:F4} delegates={2:F4} query={3:F4}",
        what, t.Shapes / all, t.Delegates / all, t.Query / all);
}

public interface IShape
{
    double Area(Span<double> scratch);
}

// Five implementations: the call site in Work.Shapes sees all of them.
public sealed record Circle(double Radius) : IShape
{
    public double Area(Span<double> scratch)
    {
        for (int i = 0; i < scratch.Length; i++)
            scratch[i] = Math.PI * Radius * Radius / (i + 1);
        return Numeric.Sum<double>(scratch);
    }
}

public sealed record Square(double Side) : IShape
{
    public double Area(Span<double> scratch)
    {
        for (int i = 0; i < scratch.Length; i++)
            scratch[i] = Side * Side - i * 0.5;
        return Numeric.Sum<double>(scratch);
    }
}

public sealed record Rect(double Width, double Height) : IShape
{
    public double Area(Span<double> scratch)
    {
        for (int i = 0; i < scratch.Length; i++)
            scratch[i] = Width * (Height + i);
        return Numeric.Sum<double>(scratch) / scratch.Length;
    }
}

public sealed record Triangle(double Base, double Height) : IShape
{
    public double Area(Span<double> scratch)
    {
        for (int i = 0; i < scratch.Length; i++)
            scratch[i] = 0.5 * Base * Height * Math.Sqrt(i + 1);
        return Numeric.Sum<double>(scratch);
    }
}

public sealed record Polygon(int Sides, double Radius) : IShape
{
    public double Area(Span<double> scratch)
    {
        double step = 2 * Math.PI / Sides;
        for (int i = 0; i < scratch.Length; i++)
            scratch[i] = 0.5 * Sides * Radius * Radius * Math.Sin(step * (i % Sides + 1));
        return Numeric.Sum<double>(scratch);
    }
}

public static class Numeric
{
    public static T Sum<T>(ReadOnlySpan<T> values) where T : INumber<T>
    {
        T total = T.Zero;
        foreach (T v in values)
            total += v;
        return total;
    }
}

public sealed record Order(int Id, string Region, int Quantity, decimal Price);

public sealed record RegionTotal(string Region, decimal Amount, int Count);

public sealed class PhaseTotals
{
    long _shapes, _delegates, _query;
    public double Shapes => Interlocked.Read(ref _shapes);
    public double Delegates => Interlocked.Read(ref _delegates);
    public double Query => Interlocked.Read(ref _query);

    public void Add(long shapes, long delegates, long query)
    {
        Interlocked.Add(ref _shapes, shapes);
        Interlocked.Add(ref _delegates, delegates);
        Interlocked.Add(ref _query, query);
    }
}

public static class Catalog
{
    static readonly string[] Regions = { "EU", "US", "UK", "APAC", "LATAM" };

    public static IShape[] Shapes() => new IShape[]
    {
        new Circle(1.5), new Square(2.0), new Rect(1.0, 3.0), new Triangle(4.0, 2.5), new Polygon(6, 1.2),
    };

    public static Order[] Orders(int count)
    {
        var rng = new Random(42);
        return Enumerable.Range(0, count)
            .Select(i => new Order(i, Regions[rng.Next(Regions.Length)], 1 + rng.Next(20), 0.99m + rng.Next(5000) / 100m))
            .ToArray();
    }
}

// The calling thread's CPU time, in nanoseconds.
public static class CpuClock
{
    struct Timespec { public long Seconds; public long Nanoseconds; }

    [DllImport("libc")]
    static extern int clock_gettime(int clock, out Timespec time);

    const int CLOCK_THREAD_CPUTIME_ID = 3;

    public static long ThreadNs()
    {
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, out Timespec t);
        return t.Seconds * 1_000_000_000 + t.Nanoseconds;
    }
}

public static class Work
{
    static long s_checksum;
    public static long Checksum => Interlocked.Read(ref s_checksum);

    // One work item: the three phases, timed.
    public static void Round(int worker, int round, IShape[] shapes, Order[] orders, PhaseTotals cpu, PhaseTotals wall)
    {
        long freq = Stopwatch.Frequency;
        long c0 = CpuClock.ThreadNs();
        long t0 = Stopwatch.GetTimestamp();
        double area = Shapes(shapes, t0 + freq * 3 / 1000);
        long c1 = CpuClock.ThreadNs();
        long t1 = Stopwatch.GetTimestamp();
        double curve = Delegates(worker + round % 7, t1 + freq * 2 / 1000);
        long c2 = CpuClock.ThreadNs();
        long t2 = Stopwatch.GetTimestamp();
        decimal best = Query(orders, round % 10, t2 + freq * 15 / 10000);
        long c3 = CpuClock.ThreadNs();
        long t3 = Stopwatch.GetTimestamp();
        cpu.Add(c1 - c0, c2 - c1, c3 - c2);
        wall.Add(t1 - t0, t2 - t1, t3 - t2);
        Interlocked.Add(ref s_checksum, (long)area + (long)curve + (long)best);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static double Shapes(IShape[] shapes, long until)
    {
        Span<double> scratch = stackalloc double[32];
        double total = 0;
        do
        {
            for (int i = 0; i < 64; i++)
                total += shapes[i % shapes.Length].Area(scratch);
        } while (Stopwatch.GetTimestamp() < until);
        return total;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static double Delegates(int seed, long until)
    {
        double scale = 1.0 + seed * 0.01;
        double offset = seed * 0.5;
        // Closures over the locals above, as a pipeline of steps.
        var steps = new List<Func<double, double>>
        {
            x => x * scale + offset,
            x => Math.Sqrt(Math.Abs(x) + 1.0),
            x => x - Math.Floor(x / 97.0) * 97.0,
        };
        double acc = seed;
        do
        {
            for (int i = 0; i < 128; i++)
                acc = Apply(acc + i);
        } while (Stopwatch.GetTimestamp() < until);
        return acc;

        double Apply(double x)
        {
            foreach (var step in steps)
                x = step(x);
            return x;
        }
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static decimal Query(Order[] orders, int minQuantity, long until)
    {
        decimal best = 0;
        do
        {
            var top = orders
                .Where(o => o.Quantity > minQuantity)
                .GroupBy(o => o.Region)
                .Select(g => new RegionTotal(g.Key, g.Sum(o => o.Price * o.Quantity), g.Count()))
                .OrderByDescending(t => t.Amount)
                .First();
            best = Math.Max(best, top.Amount);
        } while (Stopwatch.GetTimestamp() < until);
        return best;
    }
}
