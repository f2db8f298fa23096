// Event-heavy workloads with a fixed amount of work; prints the time the
// work took (start-up excluded).
//   dotnet events.dll exceptions N   -- N throw/catch pairs, 4 frames deep
//   dotnet events.dll alloc N        -- N rounds of building small object graphs
//   dotnet events.dll requests N     -- N requests, each parsing 64 numbers out
//                                       of text; every other request has a
//                                       malformed one, and int.Parse throws
//   dotnet events.dll validate N     -- N records validated by two thread-pool
//                                       workers (N/2 each); one record in four
//                                       is bad and its validation throws a
//                                       ValidationException 3 frames down
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

    sealed class ValidationException : Exception
    {
        public ValidationException(string message) : base(message) { }
    }

    static readonly string[] s_records = MakeRecords();

    static string[] MakeRecords()
    {
        var records = new string[256];
        for (int k = 0; k < records.Length; k++)
        {
            records[k] = k % 4 == 3 ? $"sku-{k},-{k},9.99" : $"sku-{k},{k % 50 + 1},{k % 17}.{k % 100:D2}";
        }
        return records;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void CheckQuantity(int quantity, string record)
    {
        if (quantity <= 0) throw new ValidationException("bad quantity in " + record);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static long ValidateRecord(string record)
    {
        var fields = record.Split(',');
        int quantity = int.Parse(fields[1], System.Globalization.CultureInfo.InvariantCulture);
        decimal price = decimal.Parse(fields[2], System.Globalization.CultureInfo.InvariantCulture);
        CheckQuantity(quantity, record);
        return (long)(quantity * price) + fields[0].GetHashCode() % 7;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static long ValidateBatch(long n, int offset)
    {
        long accepted = 0;
        for (long i = 0; i < n; i++)
        {
            try { accepted += ValidateRecord(s_records[(i + offset) % s_records.Length]); }
            catch (ValidationException) { accepted--; }
        }
        return accepted;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Validate(long n)
    {
        var a = System.Threading.Tasks.Task.Run(() => ValidateBatch(n / 2, 0));
        var b = System.Threading.Tasks.Task.Run(() => ValidateBatch(n - n / 2, 128));
        s_sink += a.Result + b.Result;
    }

    public static int Main(string[] args)
    {
        string kind = args[0];
        long n = long.Parse(args[1]);
        Action<long> work = Alloc;
        if (kind == "exceptions") work = Exceptions;
        if (kind == "requests") work = Requests;
        if (kind == "validate") work = Validate;
        work(100); // JIT before the clock
        var sw = Stopwatch.StartNew();
        work(n);
        Console.WriteLine("elapsed_ms " + sw.Elapsed.TotalMilliseconds.ToString("F1", System.Globalization.CultureInfo.InvariantCulture));
        return 0;
    }
}
