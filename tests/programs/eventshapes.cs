// Test program: exceptions thrown from many stack shapes, on the main thread
// and in thread-pool tasks, and allocations from a few, so that both event
// walkers can be compared on the same events.
//
//   dotnet eventshapes.dll [rounds=300]
//
// Shapes (each round, main thread first, then the same on the pool through
// Parallel.For, then async methods resuming on the pool):
//   Shapes.Recurse      a recursion 0..12 deep over Shapes.Leaf, which throws;
//   Shapes.Generic<T>   a generic method (int, string) that throws;
//   Shapes.FromCatch    a catch block that throws a new exception (the throw
//                       happens in a funclet, on top of the first dispatch);
//   Shapes.Filtered     an exception filter, caught or passed on;
//   Shapes.FromFinally  a throw after a finally block ran;
//   Shapes.Lambda       a lambda and a LINQ selector that throw;
//   Shapes.ViaInterface a throw through an interface call;
//   Shapes.AsyncThrow   an async method that throws after an await (the
//                       await rethrows it in its caller).
// Allocations: Shapes.AllocNodes (small objects in a list) and
// Shapes.AllocArrays (arrays, from a recursion).
// Prints "rounds <n>" then "done <checksum>", exits 0.
#nullable enable
using System;
using System.Collections.Generic;
using System.Linq;
using System.Runtime.CompilerServices;
using System.Threading;
using System.Threading.Tasks;

namespace EventShapes
{
    public sealed class ShapeException : Exception
    {
        public ShapeException(string message) : base(message) { }
    }

    public interface IThrower
    {
        int Throw(int i);
    }

    public sealed class Thrower : IThrower
    {
        [MethodImpl(MethodImplOptions.NoInlining)]
        public int Throw(int i) => throw new NotSupportedException("via interface " + i);
    }

    public sealed class Node
    {
        public Node? Next;
        public long Value;
    }

    public static class Shapes
    {
        static long s_sink;
        static readonly IThrower s_thrower = new Thrower();

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void Leaf(int i) => throw new ShapeException("leaf " + i);

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void Recurse(int depth, int i)
        {
            if (depth == 0)
            {
                Leaf(i);
            }
            else
            {
                Recurse(depth - 1, i);
            }
            Interlocked.Increment(ref s_sink);
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static T Generic<T>(T value) => throw new InvalidOperationException("generic " + value);

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void FromCatch(int i)
        {
            try
            {
                Leaf(i);
            }
            catch (ShapeException e)
            {
                throw new ArgumentException("wrapped", e);
            }
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void Filtered(int i)
        {
            try
            {
                Leaf(i);
            }
            catch (ShapeException) when (i % 2 == 0)
            {
                Interlocked.Increment(ref s_sink);
            }
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void FromFinally(int i)
        {
            try
            {
                Interlocked.Increment(ref s_sink);
            }
            finally
            {
                s_sink += i;
            }
            throw new TimeoutException("after finally " + i);
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void Lambda(int i)
        {
            Action throws = () => throw new FormatException("lambda " + i);
            throws();
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void Linq(int i)
        {
            s_sink += Enumerable.Range(0, 4).Select(v => v == 3 ? throw new KeyNotFoundException("linq " + i) : v).Sum();
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void ViaInterface(int i) => s_sink += s_thrower.Throw(i);

        [MethodImpl(MethodImplOptions.NoInlining)]
        static async Task AsyncThrow(int i)
        {
            await Task.Yield();
            Leaf(i);
        }

        static void Try(Action action)
        {
            try
            {
                action();
            }
            catch (Exception)
            {
                Interlocked.Increment(ref s_sink);
            }
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void OneRound(int round)
        {
            Try(() => Recurse(round % 13, round));
            Try(() => Generic(round));
            Try(() => Generic("s" + round));
            Try(() => FromCatch(round));
            Try(() => Filtered(round));
            Try(() => FromFinally(round));
            Try(() => Lambda(round));
            Try(() => Linq(round));
            Try(() => ViaInterface(round));
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void AllocNodes(int count)
        {
            var nodes = new List<Node>();
            for (int i = 0; i < count; i++)
            {
                nodes.Add(new Node { Value = i });
            }
            s_sink += nodes.Count;
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void AllocArrays(int depth)
        {
            if (depth > 0)
            {
                AllocArrays(depth - 1);
                return;
            }
            for (int i = 0; i < 200; i++)
            {
                s_sink += new byte[1000 + i].Length;
            }
        }

        public static int Main(string[] args)
        {
            int rounds = args.Length > 0 ? int.Parse(args[0]) : 300;
            for (int round = 0; round < rounds; round++)
            {
                OneRound(round);
                AllocNodes(2000);
                AllocArrays(round % 7);
            }
            Parallel.For(0, rounds, new ParallelOptions { MaxDegreeOfParallelism = 2 }, round =>
            {
                OneRound(round);
                AllocNodes(2000);
                AllocArrays(round % 7);
            });
            var tasks = new List<Task>();
            for (int round = 0; round < rounds; round++)
            {
                tasks.Add(Task.Run(async () =>
                {
                    try
                    {
                        await AsyncThrow(round);
                    }
                    catch (ShapeException)
                    {
                        Interlocked.Increment(ref s_sink);
                    }
                }));
            }
            Task.WaitAll(tasks.ToArray());
            Console.WriteLine("rounds " + rounds);
            Console.WriteLine("done " + s_sink);
            return 0;
        }
    }
}
