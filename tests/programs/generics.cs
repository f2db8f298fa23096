// Test program: frames in generic and nested types.
//
//   dotnet generics.dll [seconds=3]
//
// Main alternates ~3 ms in Shop.Billing.Ledger<string>.Entry.Settle<int>(5)
// and ~1 ms in Shop.Billing.Outer.Inner.Work() (metadata name
// Shop.Billing.Outer+Inner) until the deadline, then prints "done <checksum>"
// and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;

namespace Shop.Billing
{
    public class Ledger<TKey>
    {
        public class Entry
        {
            long _total;

            // Spins until Program.SliceEnd.
            [MethodImpl(MethodImplOptions.NoInlining)]
            public long Settle<TValue>(TValue v)
            {
                ulong x = (ulong)v.GetHashCode() | 1;
                do
                {
                    for (int i = 0; i < 1024; i++)
                    {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                    }
                } while (Stopwatch.GetTimestamp() < Program.SliceEnd);
                _total += (long)(x >> 1);
                Program.Sink = (int)x;
                return _total;
            }
        }
    }

    public class Outer
    {
        public class Inner
        {
            long _count;

            // Spins until Program.SliceEnd.
            [MethodImpl(MethodImplOptions.NoInlining)]
            public long Work()
            {
                ulong x = 7;
                do
                {
                    for (int i = 0; i < 1024; i++)
                    {
                        x = x * 6364136223846793005UL + 1442695040888963407UL;
                    }
                } while (Stopwatch.GetTimestamp() < Program.SliceEnd);
                _count += (long)(x >> 1);
                Program.Sink = (int)x;
                return _count;
            }
        }
    }

    public static class Program
    {
        public static long SliceEnd;
        public static volatile int Sink;

        public static int Main(string[] args)
        {
            double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
            long freq = Stopwatch.Frequency;
            long deadline = Stopwatch.GetTimestamp() + (long)(seconds * freq);
            var inner = new Outer.Inner();
            long checksum = 0;

            while (Stopwatch.GetTimestamp() < deadline)
            {
                SliceEnd = Stopwatch.GetTimestamp() + freq * 3 / 1000;
                checksum ^= new Ledger<string>.Entry().Settle<int>(5);
                SliceEnd = Stopwatch.GetTimestamp() + freq / 1000;
                checksum += inner.Work();
            }

            Console.WriteLine("done " + (checksum & long.MaxValue).ToString(CultureInfo.InvariantCulture));
            return 0;
        }
    }
}
