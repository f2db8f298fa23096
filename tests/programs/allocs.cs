// Allocates mostly one type from one method: Allocs.MakeNodes allocates
// Allocs+Node objects (about 90% of the bytes); Allocs.MakeText allocates
// strings (the rest).
//   dotnet allocs.dll [seconds, default 2]
using System;
using System.Diagnostics;
using System.Runtime.CompilerServices;

public static class Allocs
{
    public sealed class Node { public long A, B, C, D, E, F; public Node Next; }

    public static object s_keep;
    public static long s_count;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void MakeNodes(int n)
    {
        Node head = null;
        for (int i = 0; i < n; i++) head = new Node { A = i, Next = (i % 64 == 0) ? null : head };
        s_keep = head;
        s_count += n;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static void MakeText(int n)
    {
        string s = null;
        for (int i = 0; i < n; i++) s = new string('x', 8);
        s_keep = s;
        s_count += n;
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], System.Globalization.CultureInfo.InvariantCulture) : 2;
        var sw = Stopwatch.StartNew();
        while (sw.Elapsed.TotalSeconds < seconds)
        {
            MakeNodes(9000); // 9000 x 80 bytes
            MakeText(2000);  // 2000 x 40 bytes
        }
        Console.WriteLine("done " + s_count);
        return 0;
    }
}
