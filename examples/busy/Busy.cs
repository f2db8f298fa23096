// A small "order processing" service for trying out corsnap.
//
//   scripts/build-cs.sh examples/busy/Busy.cs /tmp/busy
//   "$CORSNAP_DOTNET8" /tmp/busy/Busy.dll [seconds=5]
//
// Two worker threads ("orders-1", "orders-2") each loop over a batch of order
// lines: parse the text, price the order (catalog lookup, volume discounts,
// tax), and serialize a JSON receipt. The flame graph should show
// OrderPipeline.ProcessBatch split between OrderParser, PricingEngine and
// ReceiptSerializer, with a little GC/allocation work underneath.
using System;
using System.Collections.Generic;
using System.Diagnostics;
using System.Globalization;
using System.Runtime.CompilerServices;
using System.Text;
using System.Threading;

namespace Busy.Orders
{
    public sealed class OrderLine
    {
        public string Sku;
        public int Quantity;
    }

    public sealed class Order
    {
        public int Id;
        public string Customer;
        public string Region;
        public List<OrderLine> Lines = new List<OrderLine>();
    }

    public sealed class PricedOrder
    {
        public Order Order;
        public decimal Subtotal;
        public decimal Discount;
        public decimal Tax;
        public decimal Total;
    }

    // Parses lines like "id=42;customer=ACME;region=EU;items=SKU-0007x3,SKU-0100x1".
    public static class OrderParser
    {
        static readonly char[] FieldSeparator = { ';' };
        static readonly char[] ItemSeparator = { ',' };

        [MethodImpl(MethodImplOptions.NoInlining)]
        public static Order Parse(string text)
        {
            var order = new Order();
            foreach (string field in text.Split(FieldSeparator))
            {
                int eq = field.IndexOf('=');
                string key = field.Substring(0, eq);
                string value = field.Substring(eq + 1);
                switch (key)
                {
                    case "id": order.Id = int.Parse(value, CultureInfo.InvariantCulture); break;
                    case "customer": order.Customer = value; break;
                    case "region": order.Region = value; break;
                    case "items": ParseItems(value, order.Lines); break;
                }
            }
            return order;
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static void ParseItems(string items, List<OrderLine> into)
        {
            foreach (string item in items.Split(ItemSeparator))
            {
                int x = item.LastIndexOf('x');
                into.Add(new OrderLine
                {
                    Sku = item.Substring(0, x),
                    Quantity = int.Parse(item.Substring(x + 1), CultureInfo.InvariantCulture),
                });
            }
        }
    }

    public sealed class PricingEngine
    {
        readonly Dictionary<string, decimal> _catalog = new Dictionary<string, decimal>();
        readonly Dictionary<string, decimal> _taxRates = new Dictionary<string, decimal>
        {
            { "EU", 0.21m }, { "US", 0.0725m }, { "UK", 0.20m }, { "APAC", 0.10m },
        };

        public PricingEngine(int catalogSize)
        {
            for (int i = 0; i < catalogSize; i++)
            {
                _catalog[Catalog.SkuName(i)] = 1.99m + (i * 37 % 500) / 4m;
            }
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        public PricedOrder Price(Order order)
        {
            decimal subtotal = 0m;
            foreach (OrderLine line in order.Lines)
            {
                subtotal += LookupPrice(line.Sku) * line.Quantity;
            }
            decimal discount = ApplyVolumeDiscount(order, subtotal);
            decimal tax = ComputeTax(order.Region, subtotal - discount);
            return new PricedOrder
            {
                Order = order,
                Subtotal = subtotal,
                Discount = discount,
                Tax = tax,
                Total = subtotal - discount + tax,
            };
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        decimal LookupPrice(string sku)
        {
            decimal price;
            return _catalog.TryGetValue(sku, out price) ? price : 0m;
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        static decimal ApplyVolumeDiscount(Order order, decimal subtotal)
        {
            int units = 0;
            foreach (OrderLine line in order.Lines) units += line.Quantity;
            decimal rate = units >= 50 ? 0.10m : units >= 20 ? 0.05m : 0m;
            return decimal.Round(subtotal * rate, 2);
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        decimal ComputeTax(string region, decimal amount)
        {
            decimal rate;
            if (!_taxRates.TryGetValue(region, out rate)) rate = 0m;
            return decimal.Round(amount * rate, 2, MidpointRounding.AwayFromZero);
        }
    }

    public static class ReceiptSerializer
    {
        [MethodImpl(MethodImplOptions.NoInlining)]
        public static string Serialize(PricedOrder priced)
        {
            var sb = new StringBuilder(256);
            sb.Append("{\"id\":").Append(priced.Order.Id.ToString(CultureInfo.InvariantCulture));
            sb.Append(",\"customer\":");
            AppendJsonString(sb, priced.Order.Customer);
            sb.Append(",\"lines\":[");
            for (int i = 0; i < priced.Order.Lines.Count; i++)
            {
                OrderLine line = priced.Order.Lines[i];
                if (i > 0) sb.Append(',');
                sb.Append("{\"sku\":");
                AppendJsonString(sb, line.Sku);
                sb.Append(",\"qty\":").Append(line.Quantity.ToString(CultureInfo.InvariantCulture)).Append('}');
            }
            sb.Append("],\"subtotal\":").Append(priced.Subtotal.ToString(CultureInfo.InvariantCulture));
            sb.Append(",\"discount\":").Append(priced.Discount.ToString(CultureInfo.InvariantCulture));
            sb.Append(",\"tax\":").Append(priced.Tax.ToString(CultureInfo.InvariantCulture));
            sb.Append(",\"total\":").Append(priced.Total.ToString(CultureInfo.InvariantCulture));
            sb.Append('}');
            return sb.ToString();
        }

        static void AppendJsonString(StringBuilder sb, string s)
        {
            sb.Append('"');
            foreach (char c in s)
            {
                if (c == '"' || c == '\\') sb.Append('\\');
                sb.Append(c);
            }
            sb.Append('"');
        }
    }

    public static class Catalog
    {
        static readonly string[] Customers = { "ACME", "Globex", "Initech", "Umbrella", "Hooli", "Stark" };
        static readonly string[] Regions = { "EU", "US", "UK", "APAC" };

        public static string SkuName(int i)
        {
            return "SKU-" + i.ToString("D4", CultureInfo.InvariantCulture);
        }

        // Generates a batch of order lines as they might arrive from a queue.
        public static string[] GenerateBatch(int count, int catalogSize, int seed)
        {
            var rng = new Random(seed);
            var batch = new string[count];
            var sb = new StringBuilder();
            for (int i = 0; i < count; i++)
            {
                sb.Clear();
                sb.Append("id=").Append(seed * 100000 + i)
                  .Append(";customer=").Append(Customers[rng.Next(Customers.Length)])
                  .Append(";region=").Append(Regions[rng.Next(Regions.Length)])
                  .Append(";items=");
                int lines = 1 + rng.Next(8);
                for (int l = 0; l < lines; l++)
                {
                    if (l > 0) sb.Append(',');
                    sb.Append(SkuName(rng.Next(catalogSize))).Append('x').Append(1 + rng.Next(12));
                }
                batch[i] = sb.ToString();
            }
            return batch;
        }
    }

    public sealed class OrderPipeline
    {
        readonly PricingEngine _pricing;
        readonly string[] _batch;
        public long OrdersProcessed;
        public decimal Revenue;
        public long ReceiptBytes;

        public OrderPipeline(PricingEngine pricing, string[] batch)
        {
            _pricing = pricing;
            _batch = batch;
        }

        public void RunUntil(long deadline)
        {
            do
            {
                ProcessBatch();
            } while (Stopwatch.GetTimestamp() < deadline);
        }

        [MethodImpl(MethodImplOptions.NoInlining)]
        void ProcessBatch()
        {
            foreach (string text in _batch)
            {
                Order order = OrderParser.Parse(text);
                PricedOrder priced = _pricing.Price(order);
                string receipt = ReceiptSerializer.Serialize(priced);
                OrdersProcessed++;
                Revenue += priced.Total;
                ReceiptBytes += receipt.Length;
            }
        }
    }

    public static class Program
    {
        const int CatalogSize = 2000;
        const int BatchSize = 200;
        const int WorkerCount = 2;

        public static int Main(string[] args)
        {
            double seconds = args.Length > 0 ? double.Parse(args[0], CultureInfo.InvariantCulture) : 5.0;
            long deadline = Stopwatch.GetTimestamp() + (long)(seconds * Stopwatch.Frequency);
            var pricing = new PricingEngine(CatalogSize);

            var pipelines = new OrderPipeline[WorkerCount];
            var threads = new Thread[WorkerCount];
            for (int i = 0; i < WorkerCount; i++)
            {
                var pipeline = new OrderPipeline(pricing, Catalog.GenerateBatch(BatchSize, CatalogSize, i + 1));
                pipelines[i] = pipeline;
                threads[i] = new Thread(() => pipeline.RunUntil(deadline)) { Name = "orders-" + (i + 1) };
                threads[i].Start();
            }
            foreach (Thread t in threads) t.Join();

            long orders = 0, bytes = 0;
            decimal revenue = 0m;
            foreach (OrderPipeline p in pipelines)
            {
                orders += p.OrdersProcessed;
                revenue += p.Revenue;
                bytes += p.ReceiptBytes;
            }
            Console.WriteLine(string.Format(CultureInfo.InvariantCulture,
                "processed {0} orders in {1:0.#} s on {2} threads: revenue {3:0.00}, {4} receipt bytes",
                orders, seconds, WorkerCount, revenue, bytes));
            return 0;
        }
    }
}
