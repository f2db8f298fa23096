// Test program: threads blocked in the calls a signal can disturb, while
// another thread keeps a CPU busy (so a sampler is sending signals).
//
//   dotnet blocking.dll [rounds=3]
//
// Each round, in parallel: Thread.Sleep(300), Monitor.Wait(lock, 300), a
// P/Invoke usleep(300000), and Socket.Receive on a connected socket that
// never sends, with ReceiveTimeout = 300 ms (the runtime retries a receive
// interrupted by a signal with the full timeout, so a thread signalled often
// enough would never time out). Prints one line per call with how long it
// took in milliseconds:
//   sleep <ms> / wait <ms> / usleep <ms> / receive <ms> timeout|data|error
// then "done" and exits 0.
using System;
using System.Diagnostics;
using System.Globalization;
using System.Net;
using System.Net.Sockets;
using System.Runtime.InteropServices;
using System.Threading;

public static class Blocking
{
    [DllImport("libc")]
    static extern int usleep(uint usec);

    static volatile bool s_stop;
    public static volatile int s_sink;
    static readonly object s_lock = new object();

    static void Busy()
    {
        ulong x = 1;
        while (!s_stop)
        {
            for (int i = 0; i < 100000; i++) x = x * 6364136223846793005UL + 1;
            s_sink = (int)x;
        }
    }

    static void Report(string what, Stopwatch sw, string extra)
    {
        Console.WriteLine(what + " " + sw.ElapsedMilliseconds.ToString(CultureInfo.InvariantCulture) + extra);
    }

    public static int Main(string[] args)
    {
        int rounds = args.Length > 0 ? int.Parse(args[0], CultureInfo.InvariantCulture) : 3;
        var busy = new Thread(Busy) { Name = "busy" };
        busy.Start();

        var listener = new TcpListener(IPAddress.Loopback, 0);
        listener.Start();
        var client = new Socket(AddressFamily.InterNetwork, SocketType.Stream, ProtocolType.Tcp);
        client.Connect((IPEndPoint)listener.LocalEndpoint);
        var server = listener.AcceptSocket();
        client.ReceiveTimeout = 300;

        for (int r = 0; r < rounds; r++)
        {
            var threads = new Thread[]
            {
                new Thread(() => { var sw = Stopwatch.StartNew(); Thread.Sleep(300); Report("sleep", sw, ""); }),
                new Thread(() =>
                {
                    var sw = Stopwatch.StartNew();
                    lock (s_lock) { Monitor.Wait(s_lock, 300); }
                    Report("wait", sw, "");
                }),
                new Thread(() => { var sw = Stopwatch.StartNew(); usleep(300000); Report("usleep", sw, ""); }),
                new Thread(() =>
                {
                    var sw = Stopwatch.StartNew();
                    string how;
                    try { client.Receive(new byte[16]); how = " data"; }
                    catch (SocketException e) { how = e.SocketErrorCode == SocketError.TimedOut ? " timeout" : " error " + e.SocketErrorCode; }
                    Report("receive", sw, how);
                }),
            };
            foreach (var t in threads) t.Start();
            foreach (var t in threads) t.Join();
        }
        s_stop = true;
        busy.Join();
        server.Close();
        client.Close();
        listener.Stop();
        Console.WriteLine("done");
        return 0;
    }
}
