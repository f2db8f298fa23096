// corsnap-build: aspnetcore
// A minimal-API ASP.NET Core app served by Kestrel on 127.0.0.1, for attach
// tests and benchmarks under load (wrk). GET /work?n=N runs WebApp.Work, a
// named static method (so profiles show a stable name, not a lambda's) that
// does some CPU work with LINQ and string formatting.
//
// Listens on a free port and prints "ready <pid> <port>" once it accepts
// connections, then "loaded <count>" once it has served <loaded-after>
// requests (the sign that a load is under way). Exits after <seconds>.
//   dotnet webapp.dll [seconds, default 120] [loaded-after, default 1000]
using System;
using System.Globalization;
using System.Linq;
using System.Runtime.CompilerServices;
using System.Threading;
using System.Threading.Tasks;
using Microsoft.AspNetCore.Builder;
using Microsoft.AspNetCore.Hosting;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Logging;

public static class WebApp
{
    static long s_served;
    static long s_loadedAfter;

    static bool IsPrime(int k)
    {
        for (int d = 2; d * d <= k; d++)
            if (k % d == 0)
                return false;
        return true;
    }

    [MethodImpl(MethodImplOptions.NoInlining)]
    public static string Work(int n)
    {
        var primes = Enumerable.Range(2, Math.Clamp(n, 0, 1_000_000)).Where(IsPrime).ToList();
        var text = string.Join(",", primes.Select(p => p.ToString("x", CultureInfo.InvariantCulture)));
        long served = Interlocked.Increment(ref s_served);
        if (served == s_loadedAfter)
        {
            Console.WriteLine("loaded " + served);
            Console.Out.Flush();
        }
        return $"{primes.Count} primes below {n + 2}, {text.Length} characters in hex; request {served}\n";
    }

    public static int Main(string[] args)
    {
        double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 120;
        s_loadedAfter = args.Length > 1 ? long.Parse(args[1], CultureInfo.InvariantCulture) : 1000;
        var builder = WebApplication.CreateBuilder(new WebApplicationOptions { Args = Array.Empty<string>() });
        // No console logging: a line per request would be the benchmark.
        builder.Logging.ClearProviders();
        builder.WebHost.UseUrls("http://127.0.0.1:0");
        var app = builder.Build();
        app.MapGet("/work", Work);
        app.Start();
        // Kestrel replaces port 0 with the port it bound.
        var port = new Uri(app.Urls.First()).Port;
        Console.WriteLine($"ready {Environment.ProcessId} {port}");
        Console.Out.Flush();
        Task.WaitAny(app.WaitForShutdownAsync(), Task.Delay(TimeSpan.FromSeconds(seconds)));
        app.StopAsync().Wait();
        Console.WriteLine("done " + Interlocked.Read(ref s_served));
        return 0;
    }
}
