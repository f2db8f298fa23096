// Test program for tests/names.rs: CPU time spent in methods the C#
// compiler generates (an async method, an iterator, an async iterator, a
// lambda capturing a generic method's parameter, a local function), each
// through Work.Spin.
//
//   dotnet names.dll [seconds=2]
//
// Prints "done" and exits 0.
using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Globalization;
using System.Linq;
using System.Runtime.CompilerServices;
using System.Threading.Tasks;

namespace Names
{
    public static class Work
    {
        public static volatile int s_sink;

        [MethodImpl(MethodImplOptions.NoInlining)]
        public static int Spin(int n)
        {
            double x = 0;
            for (int i = 0; i < n; i++) x += Math.Sqrt(i);
            s_sink = (int)x;
            return (int)x;
        }
    }

    public class Orders
    {
        public async Task<int> HandleAsync(int rounds)
        {
            int sum = 0;
            for (int i = 0; i < rounds; i++)
            {
                sum += Work.Spin(200000);
                await Task.Yield();
            }
            return sum;
        }
    }

    public class Repo
    {
        public IEnumerable<int> GetItems(int count)
        {
            for (int i = 0; i < count; i++) yield return Work.Spin(200000);
        }

        public async IAsyncEnumerable<int> ReadAllAsync(int count)
        {
            for (int i = 0; i < count; i++)
            {
                await Task.Yield();
                yield return Work.Spin(200000);
            }
        }
    }

    public class Builder
    {
        [MethodImpl(MethodImplOptions.NoInlining)]
        public int Build<T>(T seed, int n)
        {
            Func<int> make = () => Work.Spin(n) + seed.GetHashCode();
            return make();
        }
    }

    public class Chooser
    {
        [MethodImpl(MethodImplOptions.NoInlining)]
        public int Choose(int k)
        {
            [MethodImpl(MethodImplOptions.NoInlining)]
            int choose(int a) => Work.Spin(a) + a;
            return choose(k);
        }
    }

    public static class Program
    {
        public static async Task<int> Main(string[] args)
        {
            double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 2.0;
            var sw = Stopwatch.StartNew();
            var orders = new Orders();
            var repo = new Repo();
            while (sw.Elapsed.TotalSeconds < seconds)
            {
                await orders.HandleAsync(4);
                repo.GetItems(4).Sum();
                await foreach (var item in repo.ReadAllAsync(4)) Work.s_sink += item;
                new Builder().Build("seed", 800000);
                new Chooser().Choose(800000);
            }
            Console.WriteLine("done");
            return 0;
        }
    }
}
