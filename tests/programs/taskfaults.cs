// Test program: exceptions in thread-pool tasks, the way import jobs fail.
//
//   dotnet taskfaults.dll [seconds=3]
//
// Two workers (async methods started with Task.Run, resuming on the pool
// after `await Task.Yield()` between rounds) import lines of CSV. Each round
// has three phases, each for a set slice of Stopwatch time:
//   Batch.ImportValid    (1.5 ms) parses good lines (ReadOnlySpan<char>
//                        fields, int.Parse, decimal.Parse) into records;
//   Batch.ImportFaulty   (2.5 ms) parses lines whose quantity is not a number:
//                        int.Parse throws FormatException, Importer.Parse
//                        catches it and throws an ImportException with a
//                        formatted message, and the batch loop catches that
//                        (every 32nd error is logged with its stack trace,
//                        ex.ToString(), as services do);
//   Batch.ImportFaultyAsync (2 ms) does the same through an async method
//                        (Importer.ParseAsync) whose faulted task the batch
//                        loop awaits: the exception is rethrown by the await.
// The program adds up the CPU time each phase took (the thread's own CPU
// clock) and prints
//   share valid=<0..1> faulty=<0..1> asyncfaulty=<0..1>
//   wallshare valid=<0..1> faulty=<0..1> asyncfaulty=<0..1>   (Stopwatch time)
//   errors <count>
// then "done <checksum>" and exits 0.
#nullable enable
using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Globalization;
using System.Linq;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;
using System.Threading.Tasks;

namespace Faults.Import
{
    public sealed record Item(int Line, string Sku, int Quantity, decimal Price)
    {
        public decimal Total => Quantity * Price;
    }

    public sealed class ImportException : Exception
    {
        public int LineNumber { get; }

        public ImportException(int lineNumber, string message, Exception inner) : base(message, inner)
            => LineNumber = lineNumber;
    }

    public static class Importer
    {
        // "sku,quantity,price"
        public static Item Parse(string line, int lineNumber)
        {
            ReadOnlySpan<char> rest = line;
            ReadOnlySpan<char> sku = Next(ref rest);
            ReadOnlySpan<char> quantity = Next(ref rest);
            ReadOnlySpan<char> price = Next(ref rest);
            try
            {
                return new Item(lineNumber, sku.ToString(), int.Parse(quantity, NumberStyles.Integer, CultureInfo.InvariantCulture),
                    decimal.Parse(price, NumberStyles.Number, CultureInfo.InvariantCulture));
            }
            catch (FormatException e)
            {
                throw new ImportException(lineNumber,
                    $"line {lineNumber}: quantity '{quantity}' of {sku} is not a number ({e.Message})", e);
            }

            static ReadOnlySpan<char> Next(ref ReadOnlySpan<char> s)
            {
                int comma = s.IndexOf(',');
                ReadOnlySpan<char> field = comma < 0 ? s : s[..comma];
                s = comma < 0 ? ReadOnlySpan<char>.Empty : s[(comma + 1)..];
                return field.Trim();
            }
        }

        // As an async API would be: validation fails before the first await,
        // so the caller gets a faulted task and the await rethrows.
        public static async Task<Item> ParseAsync(string line, int lineNumber, Func<Item, bool> needsLookup)
        {
            Item item = Parse(line, lineNumber);
            if (needsLookup(item))
                await Task.Yield();
            return item;
        }
    }

    public sealed class PhaseTotals
    {
        readonly long[] _ns = new long[3];

        public void Add(int phase, long ns) => Interlocked.Add(ref _ns[phase], ns);

        public string Report(string what)
        {
            double all = _ns.Sum();
            return string.Format(CultureInfo.InvariantCulture, "{0} valid={1:F4} faulty={2:F4} asyncfaulty={3:F4}",
                what, _ns[0] / all, _ns[1] / all, _ns[2] / all);
        }
    }

    // The calling thread's CPU time, in nanoseconds.
    public static class CpuClock
    {
        struct Timespec { public long Seconds; public long Nanoseconds; }

        [DllImport("libc")]
        static extern int clock_gettime(int clock, out Timespec time);

        public static long ThreadNs()
        {
            clock_gettime(3 /* CLOCK_THREAD_CPUTIME_ID */, out Timespec t);
            return t.Seconds * 1_000_000_000 + t.Nanoseconds;
        }
    }

    public sealed class Batch
    {
        readonly string[] _valid;
        readonly string[] _faulty;
        readonly List<string> _log = new();
        public int Errors;
        public decimal Total;

        public Batch(string[] valid, string[] faulty)
        {
            _valid = valid;
            _faulty = faulty;
        }

        static long Until(int tenthsOfMs) => Stopwatch.GetTimestamp() + Stopwatch.Frequency * tenthsOfMs / 10000;

        [MethodImpl(MethodImplOptions.NoInlining)]
        public void ImportValid()
        {
            long until = Until(15);
            do
            {
                for (int i = 0; i < _valid.Length; i++)
                    Total += Importer.Parse(_valid[i], i + 1).Total;
            } while (Stopwatch.GetTimestamp() < until);
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        public void ImportFaulty()
        {
            long until = Until(25);
            int i = 0;
            do
            {
                try
                {
                    Total += Importer.Parse(_faulty[i % _faulty.Length], i + 1).Total;
                }
                catch (ImportException ex)
                {
                    Record(ex);
                }
                i++;
            } while (Stopwatch.GetTimestamp() < until);
        }

        public async Task ImportFaultyAsync()
        {
            long until = Until(20);
            int i = 0;
            do
            {
                try
                {
                    Item item = await Importer.ParseAsync(_faulty[i % _faulty.Length], i + 1, it => it.Quantity > 1_000_000);
                    Total += item.Total;
                }
                catch (ImportException ex)
                {
                    Record(ex);
                }
                i++;
            } while (Stopwatch.GetTimestamp() < until);
        }

        void Record(ImportException ex)
        {
            Errors++;
            // Services log some errors whole, stack trace included.
            _log.Add(Errors % 32 == 0 ? ex.ToString() : ex.Message);
            if (_log.Count > 64)
                _log.Clear();
        }
    }

    public static class Program
    {
        static readonly PhaseTotals s_cpu = new();
        static readonly PhaseTotals s_wall = new();

        static void Timed(int phase, Action work)
        {
            long c0 = CpuClock.ThreadNs();
            long t0 = Stopwatch.GetTimestamp();
            work();
            s_wall.Add(phase, Stopwatch.GetTimestamp() - t0);
            s_cpu.Add(phase, CpuClock.ThreadNs() - c0);
        }

        // `work` completes without suspending (the lookup is never needed), so
        // it runs on this thread from start to end, as its CPU clock assumes.
        static async Task TimedAsync(int phase, Func<Task> work)
        {
            long c0 = CpuClock.ThreadNs();
            long t0 = Stopwatch.GetTimestamp();
            await work();
            s_wall.Add(phase, Stopwatch.GetTimestamp() - t0);
            s_cpu.Add(phase, CpuClock.ThreadNs() - c0);
        }

        static async Task WorkAsync(Batch batch, long deadline)
        {
            while (Stopwatch.GetTimestamp() < deadline)
            {
                Timed(0, batch.ImportValid);
                Timed(1, batch.ImportFaulty);
                await TimedAsync(2, batch.ImportFaultyAsync);
                await Task.Yield();
            }
        }

        static string[] Lines(int count, bool faulty, int seed)
        {
            var rng = new Random(seed);
            return Enumerable.Range(0, count)
                .Select(i => string.Create(CultureInfo.InvariantCulture,
                    $"SKU-{rng.Next(10000):D4}, {(faulty ? (rng.Next(2) == 0 ? "12x" : "n/a") : rng.Next(1, 50).ToString(CultureInfo.InvariantCulture))}, {rng.Next(100, 99999) / 100m}"))
                .ToArray();
        }

        public static int Main(string[] args)
        {
            double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
            long deadline = Stopwatch.GetTimestamp() + (long)(seconds * Stopwatch.Frequency);
            var batches = Enumerable.Range(1, 2).Select(i => new Batch(Lines(64, false, i), Lines(16, true, i + 10))).ToArray();
            Task[] workers = batches.Select(b => Task.Run(() => WorkAsync(b, deadline))).ToArray();
            Task.WaitAll(workers);
            Console.WriteLine(s_cpu.Report("share"));
            Console.WriteLine(s_wall.Report("wallshare"));
            Console.WriteLine("errors " + batches.Sum(b => b.Errors).ToString(CultureInfo.InvariantCulture));
            Console.WriteLine("done " + ((long)batches.Sum(b => b.Total)).ToString(CultureInfo.InvariantCulture));
            return 0;
        }
    }
}
