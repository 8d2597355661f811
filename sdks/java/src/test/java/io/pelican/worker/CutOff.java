package io.pelican.worker;

import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.io.UncheckedIOException;
import java.net.InetAddress;
import java.net.ServerSocket;
import java.net.Socket;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;

/**
 * A loopback proxy to a server that passes everything until {@link #cut()}: then every connection through it closes
 * and no new one is accepted, as for a client cut off from the server by the network. The server and its other
 * clients go on.
 */
final class CutOff implements AutoCloseable {
    private final int target;
    private final ServerSocket listener;
    private final Set<Socket> sockets = ConcurrentHashMap.newKeySet();

    CutOff(int target) {
        this.target = target;
        try {
            this.listener = new ServerSocket(0, 50, InetAddress.getLoopbackAddress());
        } catch (IOException e) {
            throw new UncheckedIOException(e);
        }
        Thread accepting = new Thread(this::accept, "cut-off-accept");
        accepting.setDaemon(true);
        accepting.start();
    }

    int port() {
        return listener.getLocalPort();
    }

    /** Closes every connection and refuses new ones from now on. */
    void cut() {
        close(listener);
        sockets.forEach(CutOff::close);
    }

    @Override
    public void close() {
        cut();
    }

    private void accept() {
        while (!listener.isClosed()) {
            try {
                Socket client = listener.accept();
                Socket server = new Socket(InetAddress.getLoopbackAddress(), target);
                sockets.add(client);
                sockets.add(server);
                if (listener.isClosed()) {
                    cut(); // accepted while being cut
                    return;
                }
                pump(client, server);
                pump(server, client);
            } catch (IOException e) {
                return; // cut
            }
        }
    }

    private void pump(Socket from, Socket to) {
        Thread thread = new Thread(() -> {
            byte[] buffer = new byte[65536];
            try (InputStream in = from.getInputStream(); OutputStream out = to.getOutputStream()) {
                for (int read; (read = in.read(buffer)) > 0; ) {
                    out.write(buffer, 0, read);
                    out.flush();
                }
            } catch (IOException e) {
                // cut, or the other side closed
            } finally {
                close(from);
                close(to);
            }
        }, "cut-off-pump");
        thread.setDaemon(true);
        thread.start();
    }

    private static void close(java.io.Closeable socket) {
        try {
            socket.close();
        } catch (IOException e) {
            // closed already
        }
    }
}
