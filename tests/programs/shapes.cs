// Test program for the app shapes (crates/corsnap/tests/shapes.rs), published
// framework-dependent, self-contained, single-file, ReadyToRun and native AOT.
//
//   shapes [seconds=2] [exit-code=0]
//       Main -> Shapes.A -> Shapes.B -> Shapes.Hot for `seconds`, then prints
//       "jitted <n>", the number of methods the JIT compiled while the chain
//       ran (0 for ReadyToRun code with DOTNET_TieredCompilation=0: the
//       precompiled code is what ran; at least 3 when the chain is JIT'd),
//       and "done <checksum>", and exits with `exit-code`.
//   shapes serve [seconds=120]
//       Prints "ready <pid>", then runs the same chain, printing
//       "heartbeat <n>" every 100 ms, for `seconds`.
//
// Every method in the chain is kept out of line, so each is a frame of its own.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;

public static class Shapes
{
    public static volatile int s_sink;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static int Hot(int n)
    {
        int s = 0;
        for (int i = 0; i < n; i++) s += i * i ^ (s >> 3);
        return s;
    }

    [MethodImpl(MethodImplOptions.NoInlining)] static int B(int n) { return Hot(n) + 1; }
    [MethodImpl(MethodImplOptions.NoInlining)] static int A(int n) { return B(n) + 1; }

    public static int Main(string[] args)
    {
        bool serve = args.Length > 0 && args[0] == "serve";
        int next = serve ? 1 : 0;
        double seconds = args.Length > next ? double.Parse(args[next], CultureInfo.InvariantCulture) : serve ? 120 : 2;
        int code = !serve && args.Length > 1 ? int.Parse(args[1], CultureInfo.InvariantCulture) : 0;
        if (serve)
        {
            Console.WriteLine("ready " + Environment.ProcessId.ToString(CultureInfo.InvariantCulture));
            Console.Out.Flush();
        }
        long freq = Stopwatch.Frequency;
        long start = Stopwatch.GetTimestamp();
        long until = start + (long)(seconds * freq);
        long nextBeat = start + freq / 10;
        long jittedBefore = System.Runtime.JitInfo.GetCompiledMethodCount(false);
        int acc = 0;
        long beats = 0;
        long now;
        while ((now = Stopwatch.GetTimestamp()) < until)
        {
            acc += A(20000);
            if (serve && now >= nextBeat)
            {
                Console.WriteLine("heartbeat " + (++beats).ToString(CultureInfo.InvariantCulture));
                Console.Out.Flush();
                nextBeat += freq / 10;
            }
        }
        long jitted = System.Runtime.JitInfo.GetCompiledMethodCount(false) - jittedBefore;
        s_sink = acc;
        Console.WriteLine("jitted " + jitted.ToString(CultureInfo.InvariantCulture));
        Console.WriteLine("done " + acc.ToString(CultureInfo.InvariantCulture));
        return code;
    }
}
