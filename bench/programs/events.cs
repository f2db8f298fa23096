// Event-heavy workloads with a fixed amount of work; prints the time the
// work took (start-up excluded).
//   dotnet events.dll exceptions N   -- N throw/catch pairs, 4 frames deep
//   dotnet events.dll alloc N        -- N rounds of building small object graphs
//   dotnet events.dll requests N     -- N requests, each parsing 64 numbers out
//                                       of text; every other request has a
//                                       malformed one, and int.Parse throws
using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Runtime.CompilerServices;
using System.Text;

public static class Events
{
    public static long s_sink;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Throw(int depth, int i)
    {
        if (depth == 0) throw new InvalidOperationException("boom");
        Throw(depth - 1, i);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Exceptions(long n)
    {
        for (long i = 0; i < n; i++)
        {
            try { Throw(4, (int)i); } catch (InvalidOperationException) { s_sink++; }
        }
    }

    static readonly string[] s_good = MakeInputs(false);
    static readonly string[] s_bad = MakeInputs(true);

    static string[] MakeInputs(bool malformed)
    {
        var inputs = new string[64];
        for (int k = 0; k < inputs.Length; k++) inputs[k] = (k * 7919 % 100000).ToString();
        if (malformed) inputs[40] = "12x45";
        return inputs;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static long Handle(string[] inputs)
    {
        long total = 0;
        foreach (var text in inputs) total += int.Parse(text, System.Globalization.CultureInfo.InvariantCulture);
        return total;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Requests(long n)
    {
        for (long i = 0; i < n; i++)
        {
            try { s_sink += Handle((i & 1) == 0 ? s_good : s_bad); }
            catch (FormatException) { s_sink--; }
        }
    }

    sealed class Order { public int Id; public string Customer; public List<decimal> Lines = new List<decimal>(); }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Alloc(long n)
    {
        for (long i = 0; i < n; i++)
        {
            var orders = new List<Order>();
            for (int k = 0; k < 16; k++)
            {
                var o = new Order { Id = k, Customer = "customer-" + k };
                for (int l = 0; l < 4; l++) o.Lines.Add(l * 1.5m);
                orders.Add(o);
            }
            var sb = new StringBuilder();
            foreach (var o in orders) sb.Append(o.Customer).Append(';');
            s_sink += sb.Length + orders.Count;
        }
    }

    public static int Main(string[] args)
    {
        string kind = args[0];
        long n = long.Parse(args[1]);
        Action<long> work = Alloc;
        if (kind == "exceptions") work = Exceptions;
        if (kind == "requests") work = Requests;
        work(100); // JIT before the clock
        var sw = Stopwatch.StartNew();
        work(n);
        Console.WriteLine("elapsed_ms " + sw.Elapsed.TotalMilliseconds.ToString("F1", System.Globalization.CultureInfo.InvariantCulture));
        return 0;
    }
}
