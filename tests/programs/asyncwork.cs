// Test program: an async pipeline on the thread pool, in the C# people write
// today (file-scoped namespace, records, generics, Span<T>, LINQ, lambdas,
// local functions, async/await that really suspends).
//
//   dotnet asyncwork.dll [seconds=3]
//
// A producer (an async method) puts Message records into a bounded
// AsyncQueue<T> (a ConcurrentQueue and two SemaphoreSlims: WaitAsync
// suspends the producer when the queue is full and a consumer when it is
// empty, and each resumes on the pool when released). Two consumers (async
// methods started with Task.Run) take messages and, for each:
//   Stages.Checksum  hashes the payload (a Span<byte>) for 1.5 ms of
//                    Stopwatch time, in the consumer's state machine;
//   Stages.Compress  run-length encodes it for 2.5 ms, offloaded with
//                    `await Task.Run(...)` from a generic async method;
//   Stages.Render    formats receipts (records' ToString, LINQ, string
//                    interpolation) for 1 ms, after `await Task.Yield()`.
// The program adds up the CPU time each stage took (the thread's own CPU
// clock) and prints
//   share checksum=<0..1> compress=<0..1> render=<0..1>
//   wallshare checksum=<0..1> compress=<0..1> render=<0..1>   (Stopwatch time)
// then "done <checksum>" and exits 0.
#nullable enable
using System;
using System.Collections.Concurrent;
using System.Diagnostics;
using System.Globalization;
using System.Linq;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;
using System.Threading.Tasks;

namespace AsyncWork;

public sealed record Message(int Id, string Customer, byte[] Payload);

public sealed record Receipt(int Id, string Customer, int Compressed, uint Hash);

// A bounded queue whose waits are real awaits.
public sealed class AsyncQueue<T>
{
    readonly ConcurrentQueue<T> _items = new();
    readonly SemaphoreSlim _filled = new(0);
    readonly SemaphoreSlim _free;

    public AsyncQueue(int capacity) => _free = new SemaphoreSlim(capacity);

    public async ValueTask EnqueueAsync(T item, CancellationToken cancel)
    {
        await _free.WaitAsync(cancel).ConfigureAwait(false);
        _items.Enqueue(item);
        _filled.Release();
    }

    public async ValueTask<T> DequeueAsync(CancellationToken cancel)
    {
        await _filled.WaitAsync(cancel).ConfigureAwait(false);
        _items.TryDequeue(out T? item);
        _free.Release();
        return item!;
    }
}

public sealed class StageTotals
{
    readonly long[] _ns = new long[3];

    public void Add(int stage, long ns) => Interlocked.Add(ref _ns[stage], ns);

    public string Report(string what)
    {
        double all = _ns.Sum();
        return string.Format(CultureInfo.InvariantCulture, "{0} checksum={1:F4} compress={2:F4} render={3:F4}",
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

public static class Stages
{
    public static readonly StageTotals Cpu = new();
    public static readonly StageTotals Wall = new();

    // Runs `work` on the current thread and charges it to `stage`.
    public static TResult Timed<TResult>(int stage, Func<TResult> work)
    {
        long c0 = CpuClock.ThreadNs();
        long t0 = Stopwatch.GetTimestamp();
        TResult result = work();
        Wall.Add(stage, Stopwatch.GetTimestamp() - t0);
        Cpu.Add(stage, CpuClock.ThreadNs() - c0);
        return result;
    }

    static long Until(int tenthsOfMs) => Stopwatch.GetTimestamp() + Stopwatch.Frequency * tenthsOfMs / 10000;

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static uint Checksum(ReadOnlySpan<byte> payload)
    {
        long until = Until(15);
        uint hash = 2166136261;
        do
        {
            foreach (byte b in payload)
                hash = (hash ^ b) * 16777619;
        } while (Stopwatch.GetTimestamp() < until);
        return hash;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static int Compress(byte[] payload)
    {
        long until = Until(25);
        Span<byte> output = stackalloc byte[2 * 1024];
        int written;
        do
        {
            written = Encode(payload, output);
        } while (Stopwatch.GetTimestamp() < until);
        return written;

        // Run-length encoding: (count, byte) pairs.
        static int Encode(ReadOnlySpan<byte> input, Span<byte> into)
        {
            int w = 0;
            for (int i = 0; i < input.Length && w + 2 <= into.Length;)
            {
                byte b = input[i];
                int run = 1;
                while (i + run < input.Length && input[i + run] == b && run < 255)
                    run++;
                into[w++] = (byte)run;
                into[w++] = b;
                i += run;
            }
            return w;
        }
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static int Render(Receipt[] recent)
    {
        long until = Until(10);
        int length = 0;
        do
        {
            string text = string.Join("\n", recent
                .Where(r => r.Compressed > 0)
                .OrderBy(r => r.Customer, StringComparer.Ordinal)
                .Select(r => $"{r} -> {r.Hash:x8}"));
            length += text.Length;
        } while (Stopwatch.GetTimestamp() < until);
        return length;
    }
}

public sealed class Consumer
{
    readonly AsyncQueue<Message> _queue;
    readonly Receipt[] _recent = new Receipt[16];
    int _count;
    public long Checksum;

    public Consumer(AsyncQueue<Message> queue) => _queue = queue;

    public async Task RunAsync(CancellationToken cancel)
    {
        try
        {
            while (true)
            {
                Message message = await _queue.DequeueAsync(cancel).ConfigureAwait(false);
                Receipt receipt = await ProcessAsync(message).ConfigureAwait(false);
                _recent[_count++ % _recent.Length] = receipt;
                await Task.Yield();
                int rendered = Stages.Timed(2, () => Stages.Render(_recent.Where(r => r is not null).ToArray()));
                Checksum += rendered + receipt.Hash;
            }
        }
        catch (OperationCanceledException)
        {
        }
    }

    async Task<Receipt> ProcessAsync(Message message)
    {
        uint hash = Stages.Timed(0, () => Stages.Checksum(message.Payload));
        int compressed = await OffloadAsync(1, () => Stages.Compress(message.Payload)).ConfigureAwait(false);
        return new Receipt(message.Id, message.Customer, compressed, hash);
    }

    // CPU work off the current flow, awaited: the caller resumes on the pool.
    static async Task<T> OffloadAsync<T>(int stage, Func<T> work)
    {
        T result = await Task.Run(() => Stages.Timed(stage, work)).ConfigureAwait(false);
        return result;
    }
}

public static class Program
{
    static readonly string[] Customers = { "ACME", "Globex", "Initech", "Umbrella", "Hooli", "Stark" };

    static async Task ProduceAsync(AsyncQueue<Message> queue, CancellationToken cancel)
    {
        var rng = new Random(7);
        int id = 0;
        try
        {
            while (!cancel.IsCancellationRequested)
            {
                var payload = new byte[1024];
                for (int i = 0; i < payload.Length; i++)
                    payload[i] = (byte)(rng.Next(4) == 0 ? rng.Next(256) : 'a' + i / 64 % 3);
                await queue.EnqueueAsync(new Message(id++, Customers[id % Customers.Length], payload), cancel)
                    .ConfigureAwait(false);
            }
        }
        catch (OperationCanceledException)
        {
        }
    }

    public static async Task<int> Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
        using var stop = new CancellationTokenSource(TimeSpan.FromSeconds(seconds));
        var queue = new AsyncQueue<Message>(4);
        var consumers = Enumerable.Range(0, 2).Select(_ => new Consumer(queue)).ToArray();
        var tasks = consumers.Select(c => Task.Run(() => c.RunAsync(stop.Token))).ToList();
        tasks.Add(Task.Run(() => ProduceAsync(queue, stop.Token)));
        await Task.WhenAll(tasks);
        Console.WriteLine(Stages.Cpu.Report("share"));
        Console.WriteLine(Stages.Wall.Report("wallshare"));
        Console.WriteLine("done " + consumers.Sum(c => c.Checksum).ToString(CultureInfo.InvariantCulture));
        return 0;
    }
}
