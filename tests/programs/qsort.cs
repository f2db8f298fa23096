// Test program: managed -> native -> managed stacks.
//
//   dotnet qsort.dll [seconds=3]
//
// NativeSort.SortOnce sorts a pinned int array with libc qsort, whose
// comparison callback is the managed NativeSort.Compare (reverse P/Invoke).
// Compare does extra busy work so most samples land in
//   Main -> SortOnce -> [qsort in libc] -> Compare.
// Repeats until the deadline, then prints "done <checksum>" and exits 0
// (exit 1 if qsort ever leaves the array unsorted).
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;

public static unsafe class NativeSort
{
    [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
    public delegate int Comparison(IntPtr a, IntPtr b);

    // "libc" is mapped to libc.so.6 by the .NET runtime on Linux (3.1 and 8).
    [DllImport("libc")]
    static extern int getppid();

    [DllImport("libc", CallingConvention = CallingConvention.Cdecl)]
    static extern void qsort(IntPtr @base, UIntPtr num, UIntPtr size, Comparison cmp);

    const int Count = 2000;
    const int BusyIterations = 256;

    public static volatile int s_sink;
    static ulong s_busy = 1;
    static uint s_rng = 2463534242;

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static int Compare(IntPtr a, IntPtr b)
    {
        int x = *(int*)a;
        int y = *(int*)b;
        // The callback's time is spent in system calls made from Compare. A
        // runtime suspension parks a thread where it next touches managed
        // code: one spinning in managed code is usually parked on its way
        // back into native qsort, and so seen in SortOnce. One inside a
        // system call from Compare is parked on the way back into Compare,
        // with Compare, the native qsort frames and SortOnce on its stack.
        for (int round = 0; round < 4; round++)
            s_sink += getppid();
        s_busy = Burn(s_busy + (ulong)(uint)x);
        return x < y ? -1 : (x > y ? 1 : 0);
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    static ulong Burn(ulong h)
    {
        for (int i = 0; i < BusyIterations; i++)
        {
            h ^= h << 13;
            h ^= h >> 7;
            h ^= h << 17;
        }
        return h;
    }

    // Fills the array with pseudo-random values and sorts it with libc qsort.
    // Returns false if the result is not sorted.
    [MethodImpl(MethodImplOptions.NoInlining)]
    public static bool SortOnce(int[] data, IntPtr pinned, Comparison cmp)
    {
        uint r = s_rng;
        for (int i = 0; i < data.Length; i++)
        {
            r ^= r << 13;
            r ^= r >> 17;
            r ^= r << 5;
            data[i] = (int)(r % 1000000);
        }
        s_rng = r;

        qsort(pinned, (UIntPtr)(uint)data.Length, (UIntPtr)(uint)sizeof(int), cmp);

        for (int i = 1; i < data.Length; i++)
        {
            if (data[i - 1] > data[i]) return false;
        }
        return true;
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 3.0;
        long deadline = Stopwatch.GetTimestamp() + (long)(seconds * Stopwatch.Frequency);

        int[] data = new int[Count];
        GCHandle handle = GCHandle.Alloc(data, GCHandleType.Pinned);
        Comparison cmp = Compare;
        ulong checksum = 0;
        int sorts = 0;
        try
        {
            IntPtr pinned = handle.AddrOfPinnedObject();
            do
            {
                if (!SortOnce(data, pinned, cmp))
                {
                    Console.Error.WriteLine("qsort left the array unsorted");
                    return 1;
                }
                checksum = checksum * 31 + (ulong)data[Count / 2];
                sorts++;
            } while (Stopwatch.GetTimestamp() < deadline);
        }
        finally
        {
            handle.Free();
        }
        GC.KeepAlive(cmp);
        s_sink = sorts;

        Console.WriteLine("done " + checksum.ToString(CultureInfo.InvariantCulture));
        return 0;
    }
}
