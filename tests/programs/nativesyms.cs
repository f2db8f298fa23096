// Test program: managed code calling a hot native function that a stripped
// library does not name (crates/corsnap/tests/symbols.rs, `--symbols`).
//
//   dotnet nativesyms.dll LIBRARY seconds     spins, then prints "done <sum>"
//   dotnet nativesyms.dll LIBRARY serve       prints "ready <pid>", then a
//                                             heartbeat line every 100 ms
//
// LIBRARY is the path of libnativesyms.so (tests/programs/nativesyms.c);
// NativeSpin.Spin calls its exported corsnap_spin, which spends its time in
// the static corsnap_hidden_spin.
using System;
using System.Diagnostics;
using System.Runtime.CompilerServices;
using System.Runtime.InteropServices;
using System.Threading;

public static unsafe class NativeSpin
{
    static delegate* unmanaged<long, double> s_spin;
    static double s_sum;

    [MethodImpl(MethodImplOptions.NoInlining)]
    static double Spin() => s_spin(200_000);

    public static int Main(string[] args)
    {
        IntPtr library = NativeLibrary.Load(args[0]);
        s_spin = (delegate* unmanaged<long, double>)NativeLibrary.GetExport(library, "corsnap_spin");
        if (args[1] == "serve")
        {
            var spinner = new Thread(() => { while (true) s_sum += Spin(); }) { IsBackground = true, Name = "spinner" };
            spinner.Start();
            Console.WriteLine("ready " + Environment.ProcessId);
            for (long beat = 0; ; beat++)
            {
                Thread.Sleep(100);
                Console.WriteLine("heartbeat " + beat);
            }
        }
        var deadline = Stopwatch.StartNew();
        double seconds = double.Parse(args[1], System.Globalization.CultureInfo.InvariantCulture);
        while (deadline.Elapsed.TotalSeconds < seconds)
            s_sum += Spin();
        Console.WriteLine("done " + s_sum.ToString("F0", System.Globalization.CultureInfo.InvariantCulture));
        return 0;
    }
}
