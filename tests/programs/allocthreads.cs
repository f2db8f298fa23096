// Test program: two threads allocate different types.
//
//   dotnet allocthreads.dll [seconds=1.5]
//
// The main thread allocates strings in Allocators.Text; a thread named
// "allocator" allocates byte arrays in Allocators.Bytes, at the same time.
// Prints "done" and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Threading;

public static class Allocators
{
    public static object s_keepBytes, s_keepText;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Bytes(double seconds)
    {
        var sw = Stopwatch.StartNew();
        while (sw.Elapsed.TotalSeconds < seconds)
            for (int i = 0; i < 1000; i++) s_keepBytes = new byte[1000];
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void Text(double seconds)
    {
        var sw = Stopwatch.StartNew();
        while (sw.Elapsed.TotalSeconds < seconds)
            for (int i = 0; i < 1000; i++) s_keepText = new string('x', 200);
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 1.5;
        var worker = new Thread(() => Bytes(seconds)) { Name = "allocator" };
        worker.Start();
        Text(seconds);
        worker.Join();
        Console.WriteLine("done");
        return 0;
    }
}
