// Throws exactly 1000 InvalidOperationException from Thrower.First and 500
// ArgumentException from Thrower.Second, catching each, then a few loads of
// a class of its own and some forced collections.
using System;
using System.Runtime.CompilerServices;

namespace Faults
{
    public class Payload { public byte[] Data = new byte[64]; }

    public static class Thrower
    {
        public static int s_caught;

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void First(int i) { throw new InvalidOperationException("first " + i); }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void Second(int i) { throw new ArgumentException("second " + i); }

        public static int Main(string[] args)
        {
            for (int i = 0; i < 1000; i++)
            {
                try { First(i); } catch (InvalidOperationException) { s_caught++; }
            }
            for (int i = 0; i < 500; i++)
            {
                try { Second(i); } catch (ArgumentException) { s_caught++; }
            }
            var p = new Payload();
            for (int i = 0; i < 3; i++)
            {
                GC.Collect(2, GCCollectionMode.Forced, true);
            }
            GC.Collect(0, GCCollectionMode.Forced, true);
            Console.WriteLine("done " + s_caught + " " + p.Data.Length);
            return 0;
        }
    }
}
