// Test program: every way a .NET program throws, each from a method of its
// own, caught each time, so that a profiler's exception counts can be
// checked kind by kind.
//
//   dotnet throwkinds.dll
//
//   Kinds.Thrown     300 x `throw new InvalidOperationException()`
//   Kinds.Rethrown   200 x `throw new FormatException()`, caught and
//                    rethrown (`throw;`) in the same method: 400 throws
//   Kinds.NullDeref  100 x a field read through a null reference (a
//                    hardware fault: NullReferenceException)
//   Kinds.Divide      50 x an integer division by zero (DivideByZeroException)
//   Kinds.ThrowsNull  50 x `throw null` (NullReferenceException)
// Prints "done <caught>" (900 when every throw was caught where expected),
// exits 0.
#nullable enable
using System;
using System.Runtime.CompilerServices;

namespace Faults
{
    public sealed class Box { public int Value = 1; }

    public static class Kinds
    {
        static Box? s_none = null;
        static int s_zero = 0;

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void Thrown(int i) { throw new InvalidOperationException("thrown " + i); }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void Rethrown(int i)
        {
            try { throw new FormatException("rethrown " + i); }
            catch (FormatException) { throw; }
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static int NullDeref(int i) { return s_none!.Value + i; }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static int Divide(int i) { return i / s_zero; }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void ThrowsNull() { throw null!; }

        public static int Main()
        {
            int caught = 0;
            for (int i = 0; i < 300; i++) { try { Thrown(i); } catch (InvalidOperationException) { caught++; } }
            for (int i = 0; i < 200; i++) { try { Rethrown(i); } catch (FormatException) { caught += 2; } }
            for (int i = 0; i < 100; i++) { try { NullDeref(i); } catch (NullReferenceException) { caught++; } }
            for (int i = 0; i < 50; i++) { try { Divide(i); } catch (DivideByZeroException) { caught++; } }
            for (int i = 0; i < 50; i++) { try { ThrowsNull(); } catch (NullReferenceException) { caught++; } }
            Console.WriteLine("done " + caught);
            return 0;
        }
    }
}
